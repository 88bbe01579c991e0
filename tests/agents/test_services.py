"""Task services on the real database: validation, claims and retries, cancellation, runs, rollouts."""

from __future__ import annotations

import gzip
import io
import tarfile
import zipfile
from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone

from training.agent.demo_repo import DEMO_PROMPT, demo_expert_policy
from webapp.agents import selectors, services
from webapp.agents.models import AgentTask, TaskEvent

pytestmark = pytest.mark.django_db


def _create(owner, repository, **extra):
    return services.task_create(owner=owner, prompt=extra.pop("prompt", DEMO_PROMPT), repository=repository,
                                backend=extra.pop("backend", "scripted"), enqueue=False, **extra)


def _tar(members: dict[str, bytes], *, link: tuple[str, str] | None = None) -> bytes:
    """A .tar.gz of ``members``, byte for byte the same on every call (gzip mtime 0): the bytes are part of
    a parametrized test's id, which pytest-xdist workers must collect identically."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        if link:
            info = tarfile.TarInfo(link[0])
            info.type = tarfile.SYMTYPE
            info.linkname = link[1]
            archive.addfile(info)
    return gzip.compress(buffer.getvalue(), mtime=0)


def test_submission_errors_say_what_is_wrong(owner, demo_repository, settings, tmp_path):
    settings.STATE_DIR = tmp_path
    with pytest.raises(ValidationError) as error:
        services.task_create(owner=owner, prompt=" ", backend="scripted", enqueue=False)
    assert error.value.message_dict["prompt"] == ["describe the task for the agent"]
    assert "choose a registered repository" in error.value.message_dict["repository"][0]
    with pytest.raises(ValidationError) as error:
        _create(owner, None, git_url="not a url")
    assert "is not a git URL" in error.value.message_dict["git_url"][0]
    with pytest.raises(ValidationError) as error:
        _create(owner, demo_repository, git_url="https://example.com/x.git")
    assert "give only one of" in error.value.message_dict["repository"][0]
    with pytest.raises(ValidationError) as error:
        _create(owner, demo_repository, limits={"max_turns": -1})
    assert "max_turns must be a positive integer" in error.value.message_dict["limits"][0]
    with pytest.raises(ValidationError) as error:
        _create(owner, demo_repository, policy_options={"temperature": 3})
    assert "unknown option 'temperature' for backend scripted" in error.value.message_dict["policy_options"][0]
    with pytest.raises(ValidationError) as error:
        _create(owner, demo_repository, backend="openai")
    assert "base URL" in error.value.message_dict["base_url"][0]
    settings.MODEL_CHECKPOINT = None
    with pytest.raises(ValidationError) as error:
        _create(owner, demo_repository, backend="builtin")
    assert "FLOWSTATE_MODEL_CHECKPOINT" in error.value.message_dict["backend"][0]
    assert not AgentTask.objects.exists()


@pytest.mark.parametrize("name, data, message", [
    ("code.rar", b"x", "not a supported archive"),
    ("code.tar.gz", b"\x1f\x8b garbage", "malformed or truncated"),
    ("code.zip", b"PK not a zip", "malformed or truncated"),
    ("code.tar.gz", _tar({"../evil.py": b"x"}), "escapes the archive"),
    ("code.tar.gz", _tar({"/etc/passwd": b"x"}), "absolute path"),
    ("code.tar.gz", _tar({"a.py": b"x"}, link=("b", "/etc/shadow")), "points outside"),
])
def test_unsafe_or_malformed_archives_are_refused(owner, settings, tmp_path, name, data, message):
    settings.STATE_DIR = tmp_path
    with pytest.raises(ValidationError) as error:
        _create(owner, None, archive=SimpleUploadedFile(name, data))
    assert message in error.value.message_dict["archive"][0]
    assert not list((tmp_path / "uploads").glob("*")) if (tmp_path / "uploads").exists() else True


def test_oversized_archive_is_refused(owner, settings, tmp_path):
    settings.STATE_DIR = tmp_path
    settings.MAX_UPLOAD_BYTES = 2048
    data = _tar({"big.bin": bytes(range(256)) * 64})
    with pytest.raises(ValidationError) as error:
        _create(owner, None, archive=SimpleUploadedFile("code.tar.gz", data + b"\0" * 4096))
    assert "the limit is 2048 bytes" in error.value.message_dict["archive"][0]


def test_valid_zip_archive_is_stored(owner, settings, tmp_path):
    settings.STATE_DIR = tmp_path
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("pkg/mod.py", "x = 1\n")
    task = _create(owner, None, archive=SimpleUploadedFile("code.zip", buffer.getvalue()))
    assert task.repo_kind == "archive" and task.repo_label == "code.zip"
    assert (tmp_path / "uploads").exists() and task.repo_location.startswith(str(tmp_path / "uploads"))


def test_run_stores_every_event_once_and_the_outcome(owner, demo_repository):
    task = _create(owner, demo_repository)
    outcome = services.task_run(task_id=task.pk)
    task.refresh_from_db()
    assert task.status == "succeeded", (outcome, task.status_reason)
    seqs = list(task.events.values_list("seq", flat=True))
    assert seqs == list(range(len(seqs))) and task.last_seq == seqs[-1]
    assert "return (ordered[middle - 1] + ordered[middle]) / 2" in task.diff
    assert task.final_message.startswith("Fixed `median`")
    assert task.turns == 6 and task.prompt_tokens > 0 and task.completion_tokens > 0
    result = task.events.filter(kind="tool_result", tool_name="run_terminal").first()
    assert "FAIL" in result.full_output and "output" not in result.payload
    assert result.payload["output_chars"] == len(result.full_output)
    assert task.claim_token is None and task.finished_at is not None
    # A second delivery of the same message does nothing.
    assert services.task_run(task_id=task.pk).startswith("skipped")
    assert task.events.count() == len(seqs)


def test_stale_claim_is_retried_and_the_old_worker_cannot_write(owner, demo_repository, settings):
    settings.AGENT_MAX_ATTEMPTS = 2
    task = _create(owner, demo_repository)
    _, first_token = services.task_claim(task_id=task.pk)
    services.task_event_append(task_id=task.pk, claim_token=first_token, event={"kind": "start", "turn": 0, "payload": {}})
    # A live worker (fresh heartbeat): a duplicate delivery must not start a second agent.
    assert services.task_claim(task_id=task.pk) is None
    AgentTask.objects.filter(pk=task.pk).update(heartbeat_at=timezone.now() - timedelta(seconds=settings.AGENT_STALE_AFTER_S + 1))
    claimed, second_token = services.task_claim(task_id=task.pk)
    assert claimed.attempt == 2 and second_token != first_token
    with pytest.raises(services.ClaimLost):
        services.task_event_append(task_id=task.pk, claim_token=first_token, event={"kind": "turn_start", "turn": 1, "payload": {}})
    assert list(task.events.values_list("seq", "kind", "attempt")) == [(0, "start", 1), (1, "retry", 1)]
    # The second attempt dies too: no attempts left, failed with the reason.
    AgentTask.objects.filter(pk=task.pk).update(heartbeat_at=timezone.now() - timedelta(seconds=settings.AGENT_STALE_AFTER_S + 1))
    assert services.task_claim(task_id=task.pk) is None
    task.refresh_from_db()
    assert task.status == "failed" and "no attempts are left" in task.status_reason


def test_cancel_queued_task_at_once_and_finished_task_refused(owner, demo_repository):
    task = _create(owner, demo_repository)
    services.task_cancel(task=task, user=owner)
    task.refresh_from_db()
    assert task.status == "cancelled" and task.status_reason == "cancelled by owner before it started"
    assert services.task_run(task_id=task.pk).startswith("skipped")
    with pytest.raises(ValidationError, match="already cancelled"):
        services.task_cancel(task=task, user=owner)


def test_cancel_requested_while_running_stops_the_agent(owner, demo_repository):
    task = _create(owner, demo_repository)
    AgentTask.objects.filter(pk=task.pk).update(cancel_requested=True, status="running", attempt=0,
                                                heartbeat_at=timezone.now() - timedelta(days=1))
    # The claim sees the request before starting anything.
    assert services.task_run(task_id=task.pk).startswith("skipped")
    task.refresh_from_db()
    assert task.status == "cancelled"


def test_infrastructure_failure_before_the_agent_is_reported(owner, settings, tmp_path):
    settings.STATE_DIR = tmp_path
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("mod.py", "x = 1\n")
    task = _create(owner, None, archive=SimpleUploadedFile("code.zip", buffer.getvalue()))
    AgentTask.objects.filter(pk=task.pk).update(repo_location=str(tmp_path / "vanished.zip"))
    services.task_run(task_id=task.pk)
    task.refresh_from_db()
    assert task.status == "failed" and task.status_reason.startswith("could not prepare the sandbox")
    error = task.events.get(kind="error")
    assert error.payload["infrastructure"] is True


def test_rollout_record_and_sft_trajectories(owner, teammate, outsider, local_sandbox):
    from training.agent.config import AgentLimits
    from training.agent.loop import run_agent

    result = run_agent(sandbox=local_sandbox, policy=demo_expert_policy(), prompt=DEMO_PROMPT, limits=AgentLimits())
    team = owner.teams.first()
    rollout = services.rollout_record(owner=owner, team=team, result=result, prompt=DEMO_PROMPT, experiment_name="grpo-toy",
                                      repo_label="toy-7", model_name="tiny-step-3", training_step=3, reward=1.0, advantage=0.5)
    assert rollout.source == "training" and rollout.status == "succeeded"
    assert rollout.events.count() == len(result.events)
    stored = rollout.events.filter(kind="tool_result").first()
    original = next(e for e in result.events if e["kind"] == "tool_result")
    assert stored.full_output == original["payload"]["output"]
    failed = services.rollout_record(owner=owner, result=result, prompt="x", experiment_name="grpo-toy",
                                     repo_label="toy-8", model_name="m", reward=0.0)
    trajectories = selectors.trajectories_for_sft(user=teammate, limit=10)
    assert trajectories == [result.messages]
    assert selectors.trajectories_for_sft(user=outsider, limit=10) == []
    assert failed.pk not in [t.pk for t in selectors.task_list(user=owner, reward_min=0.5)]
    found = selectors.task_list(user=teammate, experiment="grpo", tool="semantic_search", search="FAIL: test_median_even")
    assert list(found) == [rollout]
    assert list(selectors.task_list(user=outsider, search="median")) == []
    with pytest.raises(ValueError):
        selectors.trajectories_for_sft(limit=0)


def test_rollout_with_nul_characters_is_stored_not_lost(owner, local_sandbox):
    """A random checkpoint can emit a NUL byte; PostgreSQL text/jsonb reject it, which once failed the
    experiment monitor's ingest and stalled the run."""
    import dataclasses

    from training.agent.config import AgentLimits
    from training.agent.loop import run_agent

    result = run_agent(sandbox=local_sandbox, policy=demo_expert_policy(), prompt=DEMO_PROMPT, limits=AgentLimits())
    events = [dict(event, payload=dict(event.get("payload", {}))) for event in result.events]
    tool_result = next(event for event in events if event["kind"] == "tool_result")
    tool_result["payload"]["output"] = "binary\x00output"
    result = dataclasses.replace(
        result, final_message="done\x00", messages=[*result.messages, {"role": "assistant", "content": "a\x00b"}],
        events=events, reason="ok\x00",
    )
    rollout = services.rollout_record(owner=owner, result=result, prompt="fix\x00it", experiment_name="grpo-toy",
                                      repo_label="toy-9", model_name="m", reward=0.0)
    rollout.refresh_from_db()
    assert rollout.prompt == "fix\ufffdit" and rollout.final_message == "done\ufffd"
    assert rollout.messages[-1]["content"] == "a\ufffdb"
    assert rollout.events.get(seq=events.index(tool_result)).full_output == "binary\ufffdoutput"
    assert services.storable_text({"k\x00": ["\x00", 3, None]}) == {"k\ufffd": ["\ufffd", 3, None]}


def test_event_rows_are_unique_per_sequence(owner, demo_repository):
    from django.db import IntegrityError, transaction

    task = _create(owner, demo_repository)
    TaskEvent.objects.create(task=task, seq=0, kind="start", ts=0)
    with pytest.raises(IntegrityError), transaction.atomic():
        TaskEvent.objects.create(task=task, seq=0, kind="start", ts=0)


def test_demo_seed_is_idempotent(owner, settings, tmp_path):
    from webapp.agents.demo import demo_seed

    settings.STATE_DIR = tmp_path
    first = demo_seed(user=owner)
    second = demo_seed(user=owner)
    assert "demo task" in first and "already present" in second
    task = AgentTask.objects.get(owner=owner)
    assert task.status == "succeeded" and task.team == owner.teams.first()
    assert task.diff and task.events.filter(kind="summary").count() == 0
    assert (tmp_path / "demo" / "stats-demo" / ".git").is_dir()


def test_recovery_sweep_picks_stale_running_and_old_queued_tasks(owner, demo_repository, settings):
    """On the real broker, with no worker consuming: the sweep sends stale running tasks and old
    queued tasks without a waiting message, and sends none of them twice while its message waits."""
    from webapp.agents.selectors import broker_waiting_task_ids
    from webapp.celery import app

    app.control.purge()
    stale = _create(owner, demo_repository)
    alive = _create(owner, demo_repository)
    waiting = _create(owner, demo_repository)
    fresh = _create(owner, demo_repository)  # just submitted: its message may still be on its way
    long_ago = timezone.now() - timedelta(seconds=settings.AGENT_STALE_AFTER_S + 5)
    AgentTask.objects.filter(pk=stale.pk).update(status="running", attempt=1, heartbeat_at=long_ago)
    AgentTask.objects.filter(pk=alive.pk).update(status="running", attempt=1, heartbeat_at=timezone.now())
    AgentTask.objects.filter(pk=waiting.pk).update(created_at=timezone.now() - timedelta(minutes=5))
    try:
        assert broker_waiting_task_ids() == set()
        assert services.tasks_recover_stale() == 2
        assert broker_waiting_task_ids() == {stale.pk, waiting.pk}
        # Both messages now wait in the queue: nothing is sent twice, however often the sweep runs.
        assert services.tasks_recover_stale() == 0
        assert broker_waiting_task_ids() == {stale.pk, waiting.pk}
        app.control.purge()  # the messages are lost (a broker restart): the next sweep sends them again
        assert services.tasks_recover_stale() == 2
        assert fresh.pk not in broker_waiting_task_ids() and alive.pk not in broker_waiting_task_ids()
    finally:
        app.control.purge()


def test_publisher_merges_only_consecutive_events_of_one_task():
    import json

    def event(group, seq):
        return group, {"type": "task.event", "seq": seq, "event_json": json.dumps({"seq": seq})}

    status = ("g1", {"type": "task.status", "status": "running", "reason": "", "last_seq": 1})
    merged = services._coalesce_events([event("g1", 0), event("g1", 1), status, event("g1", 2), event("g2", 0),
                                        event("g1", 3), event("g1", 5)])
    shape = [(group, m["type"], m.get("seq"), m.get("last_seq")) for group, m in merged]
    assert shape == [("g1", "task.event", 0, 1), ("g1", "task.status", None, 1), ("g1", "task.event", 2, 2),
                     ("g2", "task.event", 0, 0), ("g1", "task.event", 3, 3), ("g1", "task.event", 5, 5)]
    assert [e["seq"] for e in json.loads(merged[0][1]["text"])["events"]] == [0, 1]
