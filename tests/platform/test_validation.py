"""Bad numbers and unknown fields get a 400 naming the field, never a 500 (issues 43 and 46).

The values below are the ones that answered 500 or were accepted before: NaN, Infinity and 1e309 in
task limits and experiment config, a huge ?limit=, max_turns=10**12, steps=1.5, steps=true,
steps=10**30, and `repository` instead of `repository_id`.
"""

from __future__ import annotations

import json

import pytest
from django.core.exceptions import ValidationError

from webapp.agents.models import AgentTask
from webapp.core.validation import Range, integer_check, number_check, query_integer, text_check
from webapp.experiments.models import Experiment

GIT_URL = "https://example.com/acme/widgets.git"


def _post_raw(api, path: str, body: str):
    """POST a JSON body written by hand, so it can hold NaN, Infinity or 1e309 literally."""
    return api.generic("POST", path, body, content_type="application/json")


def _task_body(**changes) -> dict:
    return {"prompt": "Fix the bug", "backend": "scripted", "git_url": GIT_URL, **changes}


# --- the checks themselves ----------------------------------------------------------------------

@pytest.mark.parametrize("value", [True, False, 1.5, 2.0, "5", None, [1], 10**30, -1])
def test_integer_check_refuses_everything_but_an_integer_in_range(value):
    with pytest.raises(ValueError, match="^steps must be an integer between 0 and 1000"):
        integer_check("steps", value, Range(0, 1000))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 10**400, True, "0.5", None, 2.5])
def test_number_check_refuses_non_finite_and_out_of_range(value):
    with pytest.raises(ValueError, match="^lr must be a"):
        number_check("lr", value, Range(0, 1))


def test_checks_accept_what_they_should():
    assert integer_check("n", 7, Range(1, 10)) == 7
    assert number_check("x", 1, Range(0, 1)) == 1.0 and isinstance(number_check("x", 1, Range(0, 1)), float)
    assert text_check("s", "ok") == "ok"
    with pytest.raises(ValueError, match="NUL"):
        text_check("s", "a\x00b")
    assert query_integer({"limit": " 20 "}, "limit", default=5, bounds=Range(1, 50)) == 20
    assert query_integer({}, "limit", default=5, bounds=Range(1, 50)) == 5
    for raw in ("1e3", "20.0", "x", "9" * 40, "١٢", "-"):
        with pytest.raises(ValueError, match="^limit must be an integer"):
            query_integer({"limit": raw}, "limit", default=5, bounds=Range(1, 50))


# --- task API -----------------------------------------------------------------------------------

@pytest.mark.django_db
@pytest.mark.parametrize(("literal", "field"), [
    ('{"wall_time_s": NaN}', "wall_time_s"), ('{"wall_time_s": Infinity}', "wall_time_s"),
    ('{"wall_time_s": 1e309}', "wall_time_s"), ('{"temperature": -1e309}', "temperature"),
])
def test_task_api_refuses_non_finite_limits(owner, api_client_for, literal, field):
    body = json.dumps(_task_body())[:-1] + f', "limits": {literal}}}'
    response = _post_raw(api_client_for(owner), "/api/tasks/", body)
    assert response.status_code == 400, response.content
    assert "JSON parse error" in response.json()["detail"]
    assert not AgentTask.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(("limits", "message"), [
    ({"max_turns": 10**12}, "max_turns must be an integer between 1 and 500, got 1000000000000"),
    ({"max_turns": 1.5}, "max_turns must be an integer"),
    ({"max_turns": True}, "max_turns must be an integer"),
    ({"max_turns": "7"}, "max_turns must be an integer"),
    ({"wall_time_s": 10**400}, "wall_time_s must be a finite number"),
    ({"wall_time_s": 10**9}, "wall_time_s must be a number between 1 and 86400"),
    ({"summarize_at": [0.5]}, "summarize_at must be a number"),
    ({"max_tokens_per_turn": 4096, "context_tokens": 1024}, "leaves no room for a prompt"),
    ({"max_turns": 0}, "max_turns must be a positive integer"),
])
def test_task_api_names_the_bad_limit(owner, api_client_for, limits, message):
    response = api_client_for(owner).post("/api/tasks/", _task_body(limits=limits), format="json")
    assert response.status_code == 400, response.content
    field = next(iter(limits)) if message.startswith(next(iter(limits))) else "max_tokens_per_turn"
    assert any(message in text for text in response.json()["limits"][field]), response.json()
    assert not AgentTask.objects.exists()


@pytest.mark.django_db
def test_task_api_limits_in_multipart_are_checked_the_same_way(owner, api_client_for):
    api = api_client_for(owner)
    for raw in ('{"max_turns": NaN}', '{"wall_time_s": 1e309}', '{"max_turns": 1.5}'):
        response = api.post("/api/tasks/", {**_task_body(), "limits": raw}, format="multipart")
        assert response.status_code == 400 and "limits" in response.json(), (raw, response.content)
    response = api.post("/api/tasks/", {**_task_body(), "policy_options": '{"step_delay_s": Infinity}'},
                        format="multipart")
    assert response.status_code == 400 and "policy_options" in response.json()
    assert not AgentTask.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(("options", "message"), [
    ({"step_delay_s": 61}, "step_delay_s must be a finite number between 0 and 60"),
    ({"step_delay_s": True}, "step_delay_s must be a number"),
    ({"seed": 1}, "unknown option 'seed' for backend scripted"),
])
def test_task_api_checks_policy_options(owner, api_client_for, options, message):
    response = api_client_for(owner).post("/api/tasks/", _task_body(policy_options=options), format="json")
    assert response.status_code == 400 and message in response.json()["policy_options"][0], response.content


@pytest.mark.django_db
def test_task_api_refuses_unknown_fields_and_keeps_the_old_team_name(owner, team, api_client_for):
    api = api_client_for(owner)
    response = api.post("/api/tasks/", {**_task_body(), "repository": 3, "colour": "red"}, format="json")
    assert response.status_code == 400
    assert "give repository_id" in response.json()["repository"][0]
    assert "unknown field" in response.json()["colour"][0] and "repository_id" in response.json()["colour"][0]
    both = api.post("/api/tasks/", {**_task_body(), "team": team.name, "share_with_team": team.name}, format="json")
    assert both.status_code == 400 and "not both" in both.json()["share_with_team"][0]
    old = api.post("/api/tasks/", {**_task_body(), "share_with_team": team.name}, format="json")
    new = api.post("/api/tasks/", {**_task_body(), "team": team.name}, format="json")
    assert old.status_code == new.status_code == 201
    assert old.json()["team"] == new.json()["team"] == team.name
    assert new.json()["repository_id"] is None and new.json()["repository_label"] == "widgets"
    private = api.post("/api/tasks/", _task_body(), format="json").json()
    assert private["team"] is None
    stranger = api.post("/api/tasks/", {**_task_body(), "team": "not-mine"}, format="json")
    assert stranger.status_code == 400 and "not a member" in stranger.json()["team"][0]


@pytest.mark.django_db
def test_repository_api_refuses_unknown_fields(owner, api_client_for):
    response = api_client_for(owner).post(
        "/api/repositories/", {"name": "w", "kind": "git", "location": GIT_URL, "url": GIT_URL}, format="json")
    assert response.status_code == 400 and "unknown field" in response.json()["url"][0]


@pytest.mark.django_db
def test_task_list_bounds_limit_and_offset(owner, api_client_for):
    api = api_client_for(owner)
    for _ in range(3):
        api.post("/api/tasks/", _task_body(), format="json")
    page = api.get("/api/tasks/?limit=2&offset=1").json()
    assert page["count"] == 3 and len(page["results"]) == 2
    for query, name in (("limit=" + "9" * 30, "limit"), ("limit=100000", "limit"), ("limit=0", "limit"),
                        ("limit=1e3", "limit"), ("offset=-1", "offset"), ("offset=" + "9" * 30, "offset"),
                        ("offset=NaN", "offset")):
        response = api.get(f"/api/tasks/?{query}")
        assert response.status_code == 400 and name in response.json(), (query, response.content)
    for query in ("reward_min=NaN", "reward_max=inf", "reward_min=1e309", "q=a%00b"):
        response = api.get(f"/api/tasks/?{query}")
        assert response.status_code == 400, (query, response.content)


@pytest.mark.django_db
def test_task_events_bounds_after_and_limit(owner, api_client_for):
    api = api_client_for(owner)
    pk = api.post("/api/tasks/", _task_body(), format="json").json()["id"]
    assert api.get(f"/api/tasks/{pk}/events/?after=-1&limit=2000").status_code == 200
    for query, name in (("after=" + "9" * 30, "after"), ("after=-2", "after"), ("limit=2001", "limit"),
                        ("limit=x", "limit")):
        response = api.get(f"/api/tasks/{pk}/events/?{query}")
        assert response.status_code == 400 and name in response.json(), (query, response.content)


@pytest.mark.django_db
def test_cancelling_a_finished_task_is_a_conflict(owner, api_client_for):
    api = api_client_for(owner)
    pk = api.post("/api/tasks/", _task_body(), format="json").json()["id"]
    assert api.post(f"/api/tasks/{pk}/cancel/").json()["status"] == "cancelled"
    again = api.post(f"/api/tasks/{pk}/cancel/")
    assert again.status_code == 409 and "already cancelled" in again.json()["status"][0]


# --- task form ----------------------------------------------------------------------------------

@pytest.mark.django_db
@pytest.mark.parametrize(("field", "value"), [
    ("max_turns", "1000000000000"), ("max_turns", "1.5"), ("max_turns", "NaN"), ("wall_time_s", "1e309"),
    ("max_tokens", "9" * 5000), ("step_delay_s", "Infinity"), ("step_delay_s", "nan"), ("step_delay_s", "1e309"),
])
def test_task_form_shows_the_bad_number_next_to_its_field(client, owner, field, value):
    client.force_login(owner)
    data = {"prompt": "Fix it", "backend": "scripted", "git_url": GIT_URL, "max_turns": 30, "max_tokens": 100000,
            "wall_time_s": 1800, "step_delay_s": 0.5, field: value}
    response = client.post("/tasks/", data)
    assert response.status_code == 200 and not AgentTask.objects.exists()
    assert field in response.context["form"].errors


# --- experiments --------------------------------------------------------------------------------

def _small_config(checkpoint: str, **changes) -> dict:
    return {"init_checkpoint": checkpoint, "steps": 2, "tasks": 2, "group_size": 2, "groups_per_step": 1,
            "rollout_workers": 2, "max_turns": 1, "max_tokens_per_turn": 8, "ray_num_cpus": 1, **changes}


@pytest.mark.django_db
@pytest.mark.parametrize(("changes", "message"), [
    ({"steps": 1.5}, "steps must be an integer"),
    ({"steps": True}, "steps must be an integer"),
    ({"steps": 10**30}, "steps must be an integer between 1 and 1000000, got 1000000000000000000000000000000"),
    ({"steps": "3"}, "steps must be an integer"),
    ({"lr": 10**400}, "lr must be a finite number"),
    ({"rollout_workers": 10**6, "inference_actors": 1}, "rollout_workers must be an integer between 1 and 1024"),
    ({"init_checkpoint": 5}, "init_checkpoint must be a string"),
    ({"time_budget_minutes": None}, None),
    ({"sandbox_hosts": 1}, "sandbox_hosts must be true or false"),
    ({"group_size": 1}, "group_size must be >= 2: the GRPO baseline"),
    ({"run_dir": "/etc"}, "run_dir is set by the server"),
    ({"unheard_of": 1}, "unknown field"),
])
def test_experiment_api_names_the_bad_config_field(owner, api_client_for, policy_checkpoint, changes, message):
    config = _small_config(policy_checkpoint, **changes)
    response = api_client_for(owner).post("/api/experiments/", {"name": "x", "config": config}, format="json")
    if message is None:
        assert response.status_code == 201, response.content
        return
    assert response.status_code == 400, response.content
    errors = response.json()["config"]
    field = next(iter(changes))
    assert any(message in text for text in errors[field]), errors


@pytest.mark.django_db
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e309"])
def test_experiment_api_refuses_non_finite_json(owner, api_client_for, policy_checkpoint, literal):
    body = json.dumps({"name": "x", "config": _small_config(policy_checkpoint)})[:-2] + f', "lr": {literal}}}}}'
    response = _post_raw(api_client_for(owner), "/api/experiments/", body)
    assert response.status_code == 400 and "JSON parse error" in response.json()["detail"]
    assert not Experiment.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(("field", "value"), [
    ("steps", "1.5"), ("steps", "on"), ("steps", "1" + "0" * 30), ("lr", "NaN"), ("lr", "1e309"),
    ("temperature", "Infinity"), ("rollout_workers", "1000000"), ("seed", "-1"),
])
def test_experiment_form_shows_the_bad_number_next_to_its_field(client, owner, policy_checkpoint, field, value):
    client.force_login(owner)
    response = client.post("/experiments/", {"name": "x", **_small_config(policy_checkpoint), field: value})
    assert response.status_code == 400 and not Experiment.objects.exists()
    assert f'data-error-for="{field}"' in response.content.decode()


@pytest.mark.django_db
def test_experiment_state_conflicts_are_409(owner, api_client_for, policy_checkpoint):
    api = api_client_for(owner)
    pk = api.post("/api/experiments/", {"name": "x", "config": _small_config(policy_checkpoint)},
                  format="json").json()["id"]
    assert api.post(f"/api/experiments/{pk}/cancel/").json()["status"] == "cancelled"
    for action in ("pause", "resume", "cancel"):
        response = api.post(f"/api/experiments/{pk}/{action}/")
        assert response.status_code == 409 and "cancelled" in response.json()["detail"][0], action


def test_every_numeric_config_field_has_a_range():
    from training.agent.config import AgentLimits
    from training.rollout.driver import AsyncRLConfig
    from webapp.agents.validation import agent_limit_bounds
    from webapp.core.validation import dataclass_field_kinds
    from webapp.experiments.validation import SERVER_CONTROLLED_FIELDS, experiment_config_bounds

    for cls, bounds in ((AgentLimits, agent_limit_bounds()), (AsyncRLConfig, experiment_config_bounds())):
        numeric = {name for name, (kind, _) in dataclass_field_kinds(cls).items()
                   if kind in (int, float) and name not in SERVER_CONTROLLED_FIELDS}
        assert numeric == {name for name in bounds}, (cls, numeric ^ set(bounds))
        assert all(bounds[name].minimum is not None and bounds[name].maximum is not None for name in numeric)


def test_service_errors_are_keyed_by_field_for_forms():
    from django import forms

    from webapp.core.forms import form_add_service_error

    class Form(forms.Form):
        share_with_team = forms.CharField(required=False)
        name = forms.CharField(required=False)

    form = Form(data={})
    assert form.is_valid()
    form_add_service_error(form, ValidationError({"team": "not yours", "name": "taken", "other": "boom"}),
                           field_names={"team": "share_with_team"})
    assert form.errors == {"share_with_team": ["not yours"], "name": ["taken"], "__all__": ["boom"]}
    plain = Form(data={})
    plain.is_valid()
    form_add_service_error(plain, ValidationError("the experiment is already finished"))
    assert plain.non_field_errors() == ["the experiment is already finished"]


def test_service_errors_without_a_form_are_one_line():
    from webapp.core.forms import service_error_text

    assert service_error_text(ValidationError("the task already finished")) == "the task already finished"
    assert service_error_text(ValidationError({"team": "not yours", "name": "taken"})) == "not yours; taken"


# --- other inputs -------------------------------------------------------------------------------

@pytest.mark.django_db
@pytest.mark.parametrize(("extra", "param"), [
    (', "temperature": NaN', None), (', "temperature": 1e309', None), (', "seed": 1000000000000000000000000000000', "seed"),
    (', "max_tokens": 1.5', "max_tokens"), (', "max_tokens": 1000000000000', "max_tokens"), (', "top_p": true', "top_p"),
])
def test_openai_endpoint_refuses_bad_numbers(client, owner, extra, param):
    from webapp.accounts.services import api_token_get_or_create

    body = '{"model": "flowstate", "messages": [{"role": "user", "content": "hi"}]' + extra + "}"
    response = client.post("/v1/chat/completions", body, content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {api_token_get_or_create(user=owner)}")
    assert response.status_code == 400, response.content
    if param:
        assert response.json()["error"]["param"] == param


@pytest.mark.django_db
def test_lookups_with_absurd_values_are_not_found_rather_than_errors(client, owner, api_client_for):
    api = api_client_for(owner)
    huge = "9" * 30
    assert api.get(f"/api/tasks/{huge}/").status_code == 404
    assert api.get(f"/api/experiments/{huge}/").status_code == 404
    assert api.post(f"/api/experiments/{huge}/cancel/").status_code == 404
    assert api.get("/api/benchmarks/?suite=a%00b").status_code == 400
    client.force_login(owner)
    assert client.get(f"/experiments/{huge}/").status_code == 404
    assert client.get("/experiments/benchmarks/?suite=a%00b").status_code == 200
    assert client.get(f"/tasks/traces/compare/?a={huge}&b=1").status_code == 404
    assert client.get(f"/tasks/traces/?page={huge}").status_code == 200
    experiment = Experiment.objects.create(owner=owner, name="e", config={})
    assert client.get(f"/experiments/{experiment.pk}/groups/a%00b/").status_code == 404
