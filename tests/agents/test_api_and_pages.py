"""REST API and pages: submission, filters, patch download, and who may see or change what."""

from __future__ import annotations

import io
import zipfile

import pytest
from django.test import Client

from webapp.agents import services
from webapp.agents.models import AgentTask

pytestmark = pytest.mark.django_db


@pytest.fixture
def finished_task(owner, demo_repository, team):
    task = services.task_create(owner=owner, team=team, prompt="Fix the median bug", repository=demo_repository,
                                backend="scripted", enqueue=False)
    services.task_run(task_id=task.pk)
    task.refresh_from_db()
    assert task.status == "succeeded"
    return task


@pytest.fixture
def private_task(owner, demo_repository):
    return services.task_create(owner=owner, prompt="Private work", repository=demo_repository, backend="scripted",
                                enqueue=False)


def _browser(user):
    client = Client()
    client.force_login(user)
    return client


def test_api_submit_validates_and_creates(owner, demo_repository, api_client_for, django_capture_on_commit_callbacks):
    api = api_client_for(owner)
    response = api.post("/api/tasks/", {"prompt": "", "backend": "scripted"}, format="json")
    assert response.status_code == 400 and "prompt" in response.json()
    response = api.post("/api/tasks/", {"prompt": "x", "backend": "scripted", "repository_id": 999999}, format="json")
    assert response.json() == {"repository_id": ["no repository with this id is visible to you"]}
    response = api.post("/api/tasks/", {"prompt": "x", "backend": "scripted", "repository_id": demo_repository.pk,
                                        "limits": {"max_turns": 0}}, format="json")
    assert "max_turns must be a positive integer" in response.json()["limits"]["max_turns"][0]
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = api.post("/api/tasks/", {"prompt": "Fix it", "backend": "scripted", "repository_id": demo_repository.pk,
                                            "limits": {"max_turns": 12}, "policy_options": {"step_delay_s": 0.1}}, format="json")
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["status"] == "queued" and body["limits"]["max_turns"] == 12 and "api_key" not in body
    # The run is enqueued only once the row is committed.
    assert len(callbacks) == 1


def test_api_archive_upload_multipart(owner, api_client_for, settings, tmp_path):
    settings.STATE_DIR = tmp_path
    api = api_client_for(owner)
    response = api.post("/api/tasks/", {"prompt": "x", "backend": "scripted",
                                        "archive": io.BytesIO(b"garbage")}, format="multipart")
    assert response.status_code == 400
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("a.py", "x = 1\n")
    upload = io.BytesIO(buffer.getvalue())
    upload.name = "repo.zip"
    response = api.post("/api/tasks/", {"prompt": "x", "backend": "scripted", "archive": upload,
                                        "limits": '{"max_turns": 3}'}, format="multipart")
    assert response.status_code == 201, response.json()
    assert response.json()["repository_label"] == "repo.zip" and response.json()["repository_id"] is None


def test_visibility_of_tasks_for_owner_teammate_outsider(finished_task, private_task, owner, teammate, outsider, api_client_for):
    for user, visible in ((owner, {finished_task.pk, private_task.pk}), (teammate, {finished_task.pk}), (outsider, set())):
        api = api_client_for(user)
        listed = {row["id"] for row in api.get("/api/tasks/").json()["results"]}
        assert listed == visible, user.username
        for task in (finished_task, private_task):
            expected = 200 if task.pk in visible else 404
            assert api.get(f"/api/tasks/{task.pk}/").status_code == expected
            assert api.get(f"/api/tasks/{task.pk}/events/").status_code == expected
            assert api.get(f"/api/tasks/{task.pk}/patch/").status_code == expected
            page = _browser(user)
            assert page.get(f"/tasks/{task.pk}/").status_code == expected
            assert page.get(f"/tasks/{task.pk}/patch/").status_code == expected
    assert api_client_for(None).get("/api/tasks/").status_code == 401
    assert Client().get(f"/tasks/{finished_task.pk}/").status_code == 302


def test_only_the_owner_may_cancel(private_task, owner, teammate, outsider, api_client_for):
    AgentTask.objects.filter(pk=private_task.pk).update(team=owner.teams.first())
    assert api_client_for(teammate).post(f"/api/tasks/{private_task.pk}/cancel/").status_code == 404
    assert api_client_for(outsider).post(f"/api/tasks/{private_task.pk}/cancel/").status_code == 404
    assert _browser(teammate).post(f"/tasks/{private_task.pk}/cancel/").status_code == 404
    response = api_client_for(owner).post(f"/api/tasks/{private_task.pk}/cancel/")
    assert response.status_code == 200 and response.json()["status"] == "cancelled"
    assert api_client_for(owner).post(f"/api/tasks/{private_task.pk}/cancel/").status_code == 409


def test_patch_download_and_full_output(finished_task, api_client_for, owner):
    response = _browser(owner).get(f"/tasks/{finished_task.pk}/patch/")
    assert response["Content-Disposition"] == f'attachment; filename="flowstate-task-{finished_task.pk}.patch"'
    assert response.content.decode() == finished_task.diff and finished_task.diff.startswith("diff --git")
    events = api_client_for(owner).get(f"/api/tasks/{finished_task.pk}/events/?after=3&limit=2").json()
    assert [e["seq"] for e in events] == [4, 5]
    result = finished_task.events.filter(kind="tool_result").first()
    full = api_client_for(owner).get(f"/api/tasks/{finished_task.pk}/events/{result.seq}/output/")
    assert full.content.decode() == result.full_output


def test_trace_browser_filters_and_search(finished_task, private_task, owner, teammate):
    page = _browser(owner)
    body = page.get("/tasks/traces/", {"status": "succeeded"}).content.decode()
    assert f'data-task="{finished_task.pk}"' in body and f'data-task="{private_task.pk}"' not in body
    body = page.get("/tasks/traces/", {"q": "FAIL: test_median_even"}).content.decode()
    assert f'data-task="{finished_task.pk}"' in body and f'data-task="{private_task.pk}"' not in body
    body = page.get("/tasks/traces/", {"tool": "edit_file", "model": "scripted"}).content.decode()
    assert f'data-task="{finished_task.pk}"' in body
    body = page.get("/tasks/traces/", {"reward_min": "abc"}).content.decode()
    assert "reward_min must be a number" in body
    body = _browser(teammate).get("/tasks/traces/").content.decode()
    assert f'data-task="{finished_task.pk}"' in body and f'data-task="{private_task.pk}"' not in body
    compare = page.get("/tasks/traces/compare/", {"a": finished_task.pk, "b": private_task.pk})
    assert compare.status_code == 200 and compare.content.decode().count("data-trace") == 2
    assert _browser(teammate).get("/tasks/traces/compare/", {"a": finished_task.pk, "b": private_task.pk}).status_code == 404


def test_form_submission_shows_field_errors(owner, demo_repository):
    page = _browser(owner)
    response = page.post("/tasks/", {"prompt": "Fix it", "backend": "openai", "max_turns": 5, "max_tokens": 1000,
                                     "wall_time_s": 60, "repository": demo_repository.pk})
    assert response.status_code == 200
    assert "give the http(s) base URL" in response.content.decode()
    response = page.post("/tasks/", {"prompt": "Fix it", "backend": "scripted", "max_turns": 5, "max_tokens": 1000,
                                     "wall_time_s": 60, "git_url": "ftp://nope"})
    assert "is not a git URL" in response.content.decode()


def test_openapi_schema_publishes_the_task_api(owner):
    schema = _browser(owner).get("/api/schema/", {"format": "json"}).json()
    assert "/api/tasks/" in schema["paths"] and "post" in schema["paths"]["/api/tasks/"]
    assert "/api/tasks/{id}/cancel/" in schema["paths"]


def test_register_repository_from_the_page_and_the_api(owner, api_client_for):
    page = _browser(owner)
    response = page.post("/tasks/repositories/", {"name": "lib", "kind": "git", "location": "not-a-url"})
    assert "is not a git URL" in response.content.decode()
    response = page.post("/tasks/repositories/", {"name": "lib", "kind": "git", "location": "https://example.com/lib.git"})
    assert response.status_code == 302
    response = api_client_for(owner).post("/api/repositories/", {"name": "lib", "kind": "git",
                                                                 "location": "https://example.com/other.git"}, format="json")
    assert response.json() == {"name": ["you already have a repository named 'lib'"]}
    listed = api_client_for(owner).get("/api/repositories/").json()
    assert [r["name"] for r in listed] == ["lib"]
    assert "lib" in page.get("/tasks/").content.decode()


def test_owner_cancels_from_the_page(private_task, owner):
    response = _browser(owner).post(f"/tasks/{private_task.pk}/cancel/")
    assert response.status_code == 302 and response["Location"] == f"/tasks/{private_task.pk}/"
    private_task.refresh_from_db()
    assert private_task.status == "cancelled" and private_task.status_reason == "cancelled by owner before it started"
    page = _browser(owner).get(f"/tasks/{private_task.pk}/").content.decode()
    assert 'data-role="cancel"' not in page
