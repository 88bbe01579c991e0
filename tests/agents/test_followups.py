"""Follow-ups: the agent continues a task's conversation in its workspace (real local sandboxes, real
database and Redis; the scripted policy stands in for a model and documents median on a follow-up)."""

from __future__ import annotations

import threading
import time

import pytest

from webapp.agents import followups, services
from webapp.agents.models import AgentTask, TaskFollowUp

FIX = "return (ordered[middle - 1] + ordered[middle]) / 2"
DOCSTRING = "The middle value; for an even count"


def _finished_task(owner, repository, team=None) -> AgentTask:
    task = services.task_create(owner=owner, team=team, prompt="Fix the failing median test", backend="scripted",
                                repository=repository, enqueue=False)
    services.task_run(task_id=task.pk)
    task.refresh_from_db()
    assert (task.status, task.outcome) == ("succeeded", "tests_pass"), task.status_reason
    return task


def _kinds(task) -> list[str]:
    return list(task.events.order_by("seq").values_list("kind", flat=True))


@pytest.mark.django_db
def test_a_followup_to_a_finished_task_continues_in_a_rebuilt_workspace(owner, demo_repository):
    task = _finished_task(owner, demo_repository)
    first_turns, first_last_seq, first_snapshot = task.turns, task.last_seq, task.snapshot_id
    followup = followups.followup_send(task=task, user=owner, message="Please document median too")
    task.refresh_from_db()
    assert (task.status, task.outcome, task.status_reason) == ("queued", "", "follow-up queued")
    assert followups.is_continuation(task_id=task.pk)

    note = followups.continuation_run(task_id=task.pk, keep_warm=False)
    task.refresh_from_db()
    followup.refresh_from_db()
    assert note.startswith("succeeded"), note
    assert (task.status, task.outcome) == ("succeeded", "tests_pass"), (task.status_reason, task.test_summary)
    assert (followup.status, followup.workspace) == ("delivered", "rebuilt")
    # The rebuilt workspace is a new snapshot: the task page follows its index build (started with it).
    assert task.snapshot_id and task.snapshot_id != first_snapshot
    # The first run's fix came back from the patch; the follow-up's edit sits on top of it.
    assert FIX in task.diff and DOCSTRING in task.diff
    # One conversation: the first run's events, then the user's turn, the agent's turns, a new result, new tests.
    kinds = _kinds(task)
    later = kinds[first_last_seq + 1:]
    assert kinds.count("start") == 1 and later[0] == "user_message" and later[-2:] == ["final", "tests"]
    user_event = task.events.get(kind="user_message")
    assert user_event.payload["content"] == "Please document median too"
    assert user_event.payload["author"] == "owner" and user_event.payload["followup_id"] == followup.pk
    assert user_event.turn == first_turns and task.turns > first_turns
    assert [m["content"] for m in task.messages if m["role"] == "user"] == [task.prompt, "Please document median too"]


@pytest.mark.django_db
def test_a_followup_sent_while_the_task_runs_is_taken_when_the_agent_stops(owner, demo_repository):
    task = services.task_create(owner=owner, prompt="Fix the failing median test", backend="scripted",
                                repository=demo_repository, enqueue=False)
    followups.followup_send(task=task, user=owner, message="And document it")
    task.refresh_from_db()
    assert task.status == "queued"  # not finished: nothing reopened, the message waits
    services.task_run(task_id=task.pk)
    task.refresh_from_db()
    kinds = _kinds(task)
    assert kinds.count("final") == 1 and kinds.index("user_message") < kinds.index("final")
    assert FIX in task.diff and DOCSTRING in task.diff and task.outcome == "tests_pass"
    assert TaskFollowUp.objects.get(task=task).workspace == "same run"


@pytest.mark.django_db
def test_a_patch_that_no_longer_applies_fails_the_followup_with_the_reason(owner, demo_repository):
    task = _finished_task(owner, demo_repository)
    AgentTask.objects.filter(pk=task.pk).update(diff=task.diff.replace("ordered = sorted(values)", "ordered = 42"))
    followups.followup_send(task=task, user=owner, message="Continue")
    followups.continuation_run(task_id=task.pk, keep_warm=False)
    task.refresh_from_db()
    assert task.status == "failed" and "patch no longer applies" in task.status_reason


@pytest.mark.django_db(transaction=True)
def test_the_finished_tasks_sandbox_stays_warm_for_a_followup(owner, demo_repository, settings):
    settings.AGENT_FOLLOWUP_WARM_S = 4
    task = services.task_create(owner=owner, prompt="Fix the failing median test", backend="scripted",
                                repository=demo_repository, enqueue=False)
    notes: list[str] = []

    def work() -> None:
        from django.db import connection

        try:
            notes.append(services.task_run(task_id=task.pk, keep_warm=True))
        finally:
            connection.close()

    worker = threading.Thread(target=work)
    worker.start()
    deadline = time.monotonic() + 60
    while AgentTask.objects.get(pk=task.pk).status != "succeeded":
        assert time.monotonic() < deadline and worker.is_alive(), "the first run did not finish"
        time.sleep(0.1)
    followup = followups.followup_send(task=AgentTask.objects.get(pk=task.pk), user=owner, message="Document it")
    worker.join(timeout=60)
    assert not worker.is_alive() and notes[0].startswith("succeeded")
    task.refresh_from_db()
    followup.refresh_from_db()
    assert followup.workspace == "warm" and task.status == "succeeded" and DOCSTRING in task.diff
    assert _kinds(task)[-2:] == ["final", "tests"] and task.outcome == "tests_pass"


@pytest.mark.django_db
def test_followup_api_personas(owner, teammate, outsider, demo_repository, team, api_client_for):
    task = services.task_create(owner=owner, team=team, prompt="Fix it", backend="scripted",
                                repository=demo_repository, enqueue=False)
    url = f"/api/tasks/{task.pk}/followups/"
    assert api_client_for(teammate).post(url, {"message": "hi"}, format="json").status_code == 404
    assert api_client_for(outsider).post(url, {"message": "hi"}, format="json").status_code == 404
    assert api_client_for(outsider).get(url).status_code == 404
    response = api_client_for(owner).post(url, {"message": "Also add a test"}, format="json")
    assert response.status_code == 202, response.content
    assert response.json()["status"] == "pending" and response.json()["author"] == "owner"
    listed = api_client_for(teammate).get(url)  # teammates read the conversation
    assert listed.status_code == 200 and [f["message"] for f in listed.json()] == ["Also add a test"]
    bad = api_client_for(owner).post(url, {"message": "x", "prompt": "y"}, format="json")
    assert bad.status_code == 400 and "prompt" in bad.json()
    assert api_client_for(owner).post(url, {"message": "   "}, format="json").status_code == 400


@pytest.mark.django_db
def test_a_training_rollout_cannot_be_continued(owner, api_client_for):
    rollout = AgentTask.objects.create(owner=owner, source="training", repo_kind="path", repo_location="",
                                       repo_label="toy", prompt="p", backend="builtin", model_name="m",
                                       status="succeeded", experiment_name="e")
    response = api_client_for(owner).post(f"/api/tasks/{rollout.pk}/followups/", {"message": "more"}, format="json")
    assert response.status_code == 409, response.content


@pytest.mark.django_db
def test_the_task_page_offers_the_followup_form_to_its_owner_only(owner, teammate, demo_repository, team):
    from django.test import Client

    task = services.task_create(owner=owner, team=team, prompt="Fix it", backend="scripted",
                                repository=demo_repository, enqueue=False)
    pages = {}
    for user in (owner, teammate):
        client = Client()
        client.force_login(user)
        pages[user.username] = client.get(f"/tasks/{task.pk}/").content.decode()
    assert 'id="followup-form"' in pages["owner"] and 'id="followup-form"' not in pages["teammate"]
    client = Client()
    client.force_login(owner)
    response = client.post(f"/tasks/{task.pk}/followup/", {"message": "Also check the mean"})
    assert response.status_code == 302 and TaskFollowUp.objects.get(task=task).message == "Also check the mean"


@pytest.mark.django_db
def test_cancelling_drops_waiting_followups_and_a_new_one_reopens_the_task(owner, demo_repository):
    task = services.task_create(owner=owner, prompt="Fix it", backend="scripted", repository=demo_repository,
                                enqueue=False)
    first = followups.followup_send(task=task, user=owner, message="first")
    services.task_cancel(task=task, user=owner)
    second = followups.followup_send(task=AgentTask.objects.get(pk=task.pk), user=owner, message="second")
    first.refresh_from_db()
    task.refresh_from_db()
    assert first.status == "dropped" and second.status == "pending" and task.status == "queued"
