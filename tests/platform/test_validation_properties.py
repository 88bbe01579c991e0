"""Property-based tests (hypothesis) of the task and experiment REST APIs and HTML forms (issue 43).

For any JSON value in any field (nested objects and lists, huge integers, NaN, Infinity, 1e309 written
literally, strings with NUL characters) the answer is never a 5xx; values inside the documented types
and ranges are still accepted. Example counts are kept small: each test runs in seconds on 2 cores.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from webapp.agents.validation import agent_limit_bounds

pytestmark = pytest.mark.django_db

GIT_URL = "https://example.com/acme/widgets.git"
OVERFLOW = "@@1e309@@"
"""Stands for the JSON number 1e309 (a float overflow) in generated values; see `_encode`."""

PROPERTY = settings(max_examples=40, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

_leaves = (
    st.none() | st.booleans() | st.integers() | st.integers(min_value=-(10**40), max_value=10**40)
    | st.floats() | st.text(max_size=20) | st.just(OVERFLOW) | st.sampled_from(["1e309", "NaN", "12", "0.5"])
)
JSON_VALUES = st.recursive(
    _leaves, lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=12), children,
                                                                                    max_size=3),
    max_leaves=8,
)
LIMIT_FIELDS = sorted(agent_limit_bounds())


def _encode(body: dict) -> str:
    """JSON as a client might write it: NaN/Infinity literals (Python's json) and 1e309 where marked."""
    return json.dumps(body, allow_nan=True).replace(json.dumps(OVERFLOW), "1e309")


def _post(api, path: str, body: dict):
    return api.generic("POST", path, _encode(body), content_type="application/json")


def _task_body(**changes) -> dict:
    return {"prompt": "Fix the bug", "backend": "scripted", "git_url": GIT_URL, **changes}


def _experiment_config(checkpoint: str, **changes) -> dict:
    return {"init_checkpoint": checkpoint, "steps": 2, "tasks": 2, "group_size": 2, "groups_per_step": 1,
            "rollout_workers": 2, "max_turns": 1, "max_tokens_per_turn": 8, "ray_num_cpus": 1, **changes}


def _config_fields() -> list[str]:
    from webapp.experiments.selectors import experiment_form_fields

    return [spec["name"] for spec in experiment_form_fields()]


# --- task API -----------------------------------------------------------------------------------

TASK_FIELDS = ["prompt", "backend", "repository_id", "git_url", "git_ref", "archive", "model_name", "base_url",
               "api_key", "limits", "policy_options", "team", "share_with_team", "repository", "unknown"]


@PROPERTY
@given(field=st.sampled_from(TASK_FIELDS), value=JSON_VALUES)
def test_task_api_never_fails_on_any_value_of_any_field(owner, api_client_for, field, value):
    response = _post(api_client_for(owner), "/api/tasks/", _task_body(**{field: value}))
    assert response.status_code in (201, 400), response.content


@PROPERTY
@given(limits=st.dictionaries(st.sampled_from([*LIMIT_FIELDS, "bogus"]), JSON_VALUES, max_size=3),
       options=st.dictionaries(st.sampled_from(["step_delay_s", "seed"]), JSON_VALUES, max_size=2))
def test_task_api_never_fails_on_any_limits_or_options(owner, api_client_for, limits, options):
    response = _post(api_client_for(owner), "/api/tasks/", _task_body(limits=limits, policy_options=options))
    assert response.status_code in (201, 400), response.content
    if response.status_code == 400:  # refused for what was wrong in the limits or options, by name
        body = response.json()
        assert set(body) <= {"limits", "policy_options"} or "JSON parse error" in body.get("detail", ""), body


@st.composite
def valid_limits(draw) -> dict:
    bounds = agent_limit_bounds()

    def integer(name, low=None, high=None):
        return draw(st.integers(min_value=int(low or bounds[name].minimum), max_value=int(high or bounds[name].maximum)))

    def number(name, low=None, high=None):
        return draw(st.floats(min_value=low or bounds[name].minimum, max_value=high or bounds[name].maximum,
                              allow_nan=False, allow_infinity=False))

    context = integer("context_tokens", low=2)
    per_turn = integer("max_tokens_per_turn", high=context - 1)
    chosen = {
        "max_turns": integer("max_turns"), "max_tokens": integer("max_tokens", low=per_turn),
        "max_tokens_per_turn": per_turn, "context_tokens": context, "wall_time_s": number("wall_time_s"),
        "summarize_at": number("summarize_at", high=0.999), "max_summaries": integer("max_summaries"),
        "temperature": number("temperature"), "top_p": number("top_p", low=1e-6),
        "tool_output_chars": integer("tool_output_chars"),
    }
    keep = draw(st.sets(st.sampled_from(sorted(chosen))))
    tokens = {"context_tokens", "max_tokens_per_turn", "max_tokens"}
    if keep & tokens:  # each bounds the others: drawn together, or all left at their defaults
        keep |= tokens
    return {name: value for name, value in chosen.items() if name in keep}


@PROPERTY
@given(limits=valid_limits(), delay=st.floats(min_value=0, max_value=60))
def test_task_api_accepts_every_value_in_range(owner, api_client_for, settings, limits, delay):
    settings.USER_MAX_ACTIVE_TASKS = 10**6  # every example stores a task for the same owner
    response = _post(api_client_for(owner), "/api/tasks/",
                     _task_body(limits=limits, policy_options={"step_delay_s": delay}))
    assert response.status_code == 201, response.content
    stored = response.json()
    assert {name: stored["limits"][name] for name in limits} == limits
    assert stored["policy_options"] == {"step_delay_s": delay}


# --- experiment API -----------------------------------------------------------------------------

@PROPERTY
@given(data=st.data(), value=JSON_VALUES)
def test_experiment_api_never_fails_on_any_value_of_any_field(owner, api_client_for, policy_checkpoint, data, value):
    where = data.draw(st.sampled_from(["config", "top"]))
    if where == "config":
        field = data.draw(st.sampled_from([*_config_fields(), "run_dir", "unknown"]))
        body = {"name": "x", "config": _experiment_config(policy_checkpoint, **{field: value})}
    else:
        field = data.draw(st.sampled_from(["name", "config", "team", "unknown"]))
        body = {"name": "x", "config": _experiment_config(policy_checkpoint), field: value}
    response = _post(api_client_for(owner), "/api/experiments/", body)
    assert response.status_code in (201, 400), response.content


@st.composite
def valid_experiment_changes(draw) -> dict:
    from webapp.experiments.validation import experiment_config_bounds

    bounds = experiment_config_bounds()
    group_size = draw(st.integers(min_value=2, max_value=int(bounds["group_size"].maximum)))
    workers = draw(st.integers(min_value=1, max_value=int(bounds["rollout_workers"].maximum)))
    return {
        "steps": draw(st.integers(min_value=1, max_value=int(bounds["steps"].maximum))),
        "group_size": group_size,
        "probe_size": draw(st.sampled_from([0, *range(2, group_size)][:8])),
        "rollout_workers": workers,
        "inference_actors": draw(st.integers(min_value=1, max_value=workers)),
        "lr": draw(st.floats(min_value=1e-9, max_value=1)),
        "min_lr_ratio": draw(st.floats(min_value=0, max_value=1)),
        "entropy_coef": draw(st.floats(min_value=-0.99, max_value=0.99)),
        "time_budget_minutes": draw(st.none() | st.floats(min_value=0.01, max_value=bounds["time_budget_minutes"].maximum)),
        "seed": draw(st.integers(min_value=0, max_value=2**32 - 1)),
        "sandbox_hosts": draw(st.booleans()),
    }


@PROPERTY
@given(changes=valid_experiment_changes())
def test_experiment_api_accepts_every_value_in_range(owner, api_client_for, policy_checkpoint, changes,
                                                     django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=False):
        response = _post(api_client_for(owner), "/api/experiments/",
                         {"name": "ok", "config": _experiment_config(policy_checkpoint, **changes)})
    assert response.status_code == 201, response.content
    assert {name: response.json()["config"][name] for name in changes} == changes


# --- HTML forms and query parameters ------------------------------------------------------------

_form_text = st.text(max_size=30) | st.sampled_from(["NaN", "inf", "-Infinity", "1e309", "1.5", "9" * 5000,
                                                      "1" + "0" * 30, "on", "true", "-1", ""])


@PROPERTY
@given(field=st.sampled_from(["max_turns", "max_tokens", "wall_time_s", "step_delay_s", "prompt", "backend",
                              "repository", "git_url", "share_with_team"]), value=_form_text)
def test_task_form_never_fails(client, owner, field, value):
    client.force_login(owner)
    data = {"prompt": "Fix it", "backend": "scripted", "git_url": GIT_URL, "max_turns": 30, "max_tokens": 100000,
            "wall_time_s": 1800, "step_delay_s": 0.5, field: value}
    assert client.post("/tasks/", data).status_code in (200, 302)


@PROPERTY
@given(data=st.data(), value=_form_text)
def test_experiment_form_never_fails(client, owner, policy_checkpoint, data, value,
                                     django_capture_on_commit_callbacks):
    field = data.draw(st.sampled_from([*_config_fields(), "name", "share_with_team"]))
    client.force_login(owner)
    with django_capture_on_commit_callbacks(execute=False):
        response = client.post("/experiments/", {"name": "x", **_experiment_config(policy_checkpoint), field: value})
    assert response.status_code in (302, 400)


@PROPERTY
@given(params=st.dictionaries(
    st.sampled_from(["status", "source", "model", "repository", "experiment", "tool", "reward_min", "reward_max",
                     "date_from", "date_to", "q", "limit", "offset", "page", "suite", "window_s"]), _form_text,
    max_size=4))
def test_list_query_parameters_never_fail(client, owner, api_client_for, params):
    api = api_client_for(owner)
    for path in ("/api/tasks/", "/api/benchmarks/", "/api/fleet/"):
        assert api.get(path, params).status_code in (200, 400), path
    client.force_login(owner)
    for path in ("/tasks/traces/", "/experiments/benchmarks/"):
        assert client.get(path, params).status_code == 200, path
