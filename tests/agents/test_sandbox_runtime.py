"""A task's isolation tier (sandbox_runtime): allowed values from settings, on the form and the API, and
the runtime that ran is in the trace."""

from __future__ import annotations

import pytest
from django.test import Client

import sandboxes
from webapp.agents import services
from webapp.agents.forms import TaskSubmitForm
from webapp.agents.models import AgentTask, TaskEvent

pytestmark = pytest.mark.django_db


@pytest.fixture
def tiers(settings):
    settings.SANDBOX_BACKEND = "docker"
    settings.AGENT_SANDBOX_BACKEND = None
    settings.SANDBOX_DOCKER_RUNTIME = "runc"
    settings.SANDBOX_RUNTIMES_ALLOWED = ["runc", "runsc"]
    return settings


def test_api_refuses_a_runtime_the_server_does_not_allow(owner, demo_repository, api_client_for, tiers):
    tiers.SANDBOX_RUNTIMES_ALLOWED = ["runc"]
    api = api_client_for(owner)
    for runtime in ("runsc", "kata", "../runc", "x" * 65):
        response = api.post("/api/tasks/", {"prompt": "Fix it", "backend": "scripted", "repository_id": demo_repository.pk,
                                            "sandbox_runtime": runtime}, format="json")
        assert response.status_code == 400, response.json()
        assert "sandbox_runtime" in response.json()
    assert "SANDBOX_RUNTIMES_ALLOWED" in str(api.post("/api/tasks/", {
        "prompt": "Fix it", "backend": "scripted", "repository_id": demo_repository.pk, "sandbox_runtime": "runsc",
    }, format="json").json())
    assert not AgentTask.objects.exists()


def test_api_stores_and_returns_an_allowed_runtime(owner, demo_repository, api_client_for, tiers):
    api = api_client_for(owner)
    response = api.post("/api/tasks/", {"prompt": "Fix it", "backend": "scripted", "repository_id": demo_repository.pk,
                                        "sandbox_runtime": "runsc"}, format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["sandbox_runtime"] == "runsc"
    assert AgentTask.objects.get().sandbox_runtime == "runsc"
    default = api.post("/api/tasks/", {"prompt": "Fix it", "backend": "scripted", "repository_id": demo_repository.pk},
                       format="json")
    assert default.status_code == 201 and default.json()["sandbox_runtime"] == ""


def test_a_runtime_needs_docker_sandboxes(owner, demo_repository, tiers):
    from django.core.exceptions import ValidationError

    tiers.SANDBOX_BACKEND = "local"
    with pytest.raises(ValidationError, match="needs Docker sandboxes"):
        services.task_create(owner=owner, prompt="x", repository=demo_repository, backend="scripted",
                             sandbox_runtime="runsc", enqueue=False)
    with pytest.raises(ValueError, match="needs the docker backend"):
        sandboxes.get_backend("local", runtime="runsc")


def test_form_offers_the_allowed_runtimes_and_submits_one(owner, demo_repository, tiers):
    form = TaskSubmitForm(user=owner)
    assert [value for value, _ in form.fields["sandbox_runtime"].choices] == ["", "runsc"]
    client = Client()
    client.force_login(owner)
    response = client.post("/tasks/", {"prompt": "Fix the median bug", "repository": demo_repository.pk,
                                       "backend": "scripted", "max_turns": 30, "max_tokens": 100000, "wall_time_s": 1800,
                                       "step_delay_s": 0, "sandbox_runtime": "runsc"})
    assert response.status_code == 302, response.content.decode()[:2000]
    assert AgentTask.objects.get().sandbox_runtime == "runsc"
    refused = client.post("/tasks/", {"prompt": "Fix it", "repository": demo_repository.pk, "backend": "scripted",
                                      "max_turns": 30, "max_tokens": 100000, "wall_time_s": 1800,
                                      "sandbox_runtime": "kata"})
    assert refused.status_code == 200 and "kata" in refused.content.decode()
    assert AgentTask.objects.count() == 1


@pytest.mark.docker
def test_a_task_on_runsc_runs_under_gvisor_and_its_trace_says_so(owner, demo_repository, tiers, monkeypatch):
    from sandboxes.base import BackendUnavailable
    from sandboxes.docker_runtime import engine_runtimes

    try:
        import docker

        registered = engine_runtimes(docker.from_env())
    except Exception as exc:  # noqa: BLE001 - no engine here
        pytest.skip(f"no Docker engine: {exc}")
    if "runsc" not in registered:
        pytest.skip("the Docker engine has no runsc runtime (make gvisor)")
    monkeypatch.setattr(sandboxes, "_backends", {})
    try:
        task = services.task_create(owner=owner, prompt="Fix the median bug", repository=demo_repository,
                                    backend="scripted", policy_options={"step_delay_s": 0}, sandbox_runtime="runsc",
                                    enqueue=False)
        try:
            services.task_run(task_id=task.pk)
        except BackendUnavailable as exc:
            pytest.skip(str(exc))
        task.refresh_from_db()
        assert task.status == "succeeded", task.status_reason
        start = TaskEvent.objects.get(task=task, kind="start")
        assert start.payload["sandbox_runtime"] == "runsc"
        assert set(sandboxes._backends) == {"docker:runsc"}
        assert sandboxes._backends["docker:runsc"].gvisor
    finally:
        for backend in sandboxes._backends.values():
            backend.close()


def test_an_experiment_chooses_its_tier_from_the_allowed_ones(tiers, owner, tmp_path):
    from django.core.exceptions import ValidationError

    from training.rollout.config import AsyncRLConfig, AsyncRLConfigError
    from webapp.experiments.validation import experiment_config_check

    tiers.MODEL_CHECKPOINT = str(tmp_path)
    base = {"steps": 2, "tasks": 2, "group_size": 2, "groups_per_step": 1, "max_staleness": 0, "rollout_workers": 2,
            "max_turns": 1, "max_tokens_per_turn": 8, "context_tokens": 8192, "ray_num_cpus": 1}
    assert experiment_config_check({**base, "sandbox_runtime": "runsc"}, owner=owner)["sandbox_runtime"] == "runsc"
    assert experiment_config_check(base, owner=owner)["sandbox_runtime"] is None
    with pytest.raises(ValidationError) as refused:
        experiment_config_check({**base, "sandbox_runtime": "kata"}, owner=owner)
    assert "SANDBOX_RUNTIMES_ALLOWED" in str(refused.value.message_dict["sandbox_runtime"])
    with pytest.raises(AsyncRLConfigError, match="not an OCI runtime name"):
        AsyncRLConfig(run_dir=str(tmp_path), init_checkpoint=str(tmp_path), sandbox_runtime="../runc")
    with pytest.raises(AsyncRLConfigError, match="fleet hosts"):
        AsyncRLConfig(run_dir=str(tmp_path), init_checkpoint=str(tmp_path), sandbox_runtime="runsc", sandbox_hosts=True)
