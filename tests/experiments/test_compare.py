"""The comparison view (two or more experiments' curves on one plot) and recorded recipe runs.

Visibility is the experiment pages' rule: the owner and teammates of the team an experiment is shared
with may compare it; any id the user may not see makes the whole comparison a 404 (ids are not probed).
"""

from __future__ import annotations

import datetime
import json

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse

from webapp.experiments import services
from webapp.experiments.models import Experiment, ExperimentStep
from webapp.experiments.selectors import COMPARE_MAX_EXPERIMENTS, compare_ids_check, experiment_comparison

URL = reverse("experiments:experiment-compare")


def _recorded(owner, name: str, *, team=None, lr: float = 1e-5, rows: int = 3, key: str = "pass_rate"):
    steps = [{"step": step, key: 0.1 * step, "minutes": 2.0 * step} for step in range(1, rows + 1)]
    return services.experiment_record(
        owner=owner, team=team, name=name, config={"recipe": "rl", "lr": lr, "optimizer": {"beta1": 0.9}}, steps=steps
    )


@pytest.fixture
def runs(owner, team, outsider):
    shared = _recorded(owner, "shared-rl", team=team, lr=3e-5)
    private = _recorded(owner, "private-sft", lr=5e-4, key="loss")
    foreign = _recorded(outsider, "outsider-run")
    return shared, private, foreign


def _get(client, *ids):
    return client.get(URL, {"ids": [str(pk) for pk in ids]})


@pytest.mark.django_db
def test_owner_teammate_outsider(client, runs, owner, teammate, outsider, team):
    shared, private, foreign = runs
    teammate_own = _recorded(teammate, "teammate-own", lr=1e-5)
    client.force_login(owner)
    page = _get(client, shared.pk, private.pk)
    assert page.status_code == 200
    data = page.context["comparison"]
    assert [run["name"] for run in data["runs"]] == ["shared-rl", "private-sft"]
    assert [key for key, _ in data["metrics"]] == ["pass_rate", "loss"]
    assert data["runs"][0]["series"]["pass_rate"] == [[1, 2.0, 0.1], [2, 4.0, 0.2], [3, 6.0, 0.30000000000000004]]
    assert "loss" not in data["runs"][0]["series"]
    # The owner cannot compare in someone else's run, whatever else is selected.
    assert _get(client, shared.pk, foreign.pk).status_code == 404
    assert _get(client, shared.pk, teammate_own.pk).status_code == 404  # not shared with the team
    client.force_login(teammate)
    assert _get(client, shared.pk, teammate_own.pk).status_code == 200  # shared + own
    assert _get(client, shared.pk, private.pk).status_code == 404  # the owner's private run
    client.force_login(outsider)
    assert _get(client, shared.pk, foreign.pk).status_code == 404
    assert _get(client, foreign.pk, 999_999).status_code == 404  # absent ids look like hidden ones
    client.logout()
    assert _get(client, shared.pk, private.pk).status_code == 302  # to the login page


@pytest.mark.django_db
def test_ids_are_checked_before_the_database(client, runs, owner):
    shared, private, _ = runs
    client.force_login(owner)
    for bad in ((shared.pk,), (shared.pk, shared.pk), ("1", "x"), ("1", "-2"), ("1", "0"), ("1", "9" * 40), ()):
        response = client.get(URL, {"ids": [str(value) for value in bad]})
        assert response.status_code == 400, bad
    too_many = [str(shared.pk + i) for i in range(COMPARE_MAX_EXPERIMENTS + 1)]
    assert client.get(URL, {"ids": too_many}).status_code == 400
    with pytest.raises(ValidationError):
        compare_ids_check(["1", "1e3"])
    assert compare_ids_check(["3", "1", "3"]) == [3, 1]


@pytest.mark.django_db
def test_config_differences_and_the_page(client, runs, owner):
    shared, private, _ = runs
    client.force_login(owner)
    data = experiment_comparison(user=owner, ids=[shared.pk, private.pk])
    assert data["config_differences"] == [{"field": "lr", "values": [3e-5, 5e-4]}]  # optimizer.beta1 is equal
    html = _get(client, shared.pk, private.pk).content.decode()
    assert "<code>lr</code>" in html and "optimizer.beta1" not in html
    assert 'id="compare-pass_rate"' in html and 'id="compare-loss"' in html
    assert "vendor/echarts.min.js" in html and "cdn" not in html.lower()
    runs_json = json.loads(html.split('id="compare-data" type="application/json">')[1].split("</script>")[0])
    assert [run["id"] for run in runs_json] == [shared.pk, private.pk]


@pytest.mark.django_db
def test_the_list_offers_checkboxes(client, runs, owner):
    shared, private, foreign = runs
    client.force_login(owner)
    html = client.get(reverse("experiments:experiment-list")).content.decode()
    assert f'name="ids" value="{shared.pk}"' in html and f'name="ids" value="{private.pk}"' in html
    assert f'name="ids" value="{foreign.pk}"' not in html
    assert f'action="{URL}"' in html and "Compare selected" in html


@pytest.mark.django_db
def test_minutes_fall_back_to_the_driver_clock_then_to_recording_times(owner):
    launched = Experiment.objects.create(owner=owner, name="driver", config={"steps": 3}, status="finished")
    ExperimentStep.objects.create(experiment=launched, step=1, metrics={"step": 1, "pass_rate": 0.5,
                                                                        "training_seconds": 90.0})
    older = Experiment.objects.create(owner=owner, name="older", config={"steps": 3}, status="finished")
    first = ExperimentStep.objects.create(experiment=older, step=1, metrics={"step": 1, "pass_rate": 0.25})
    second = ExperimentStep.objects.create(experiment=older, step=2, metrics={"step": 2, "pass_rate": 0.5})
    ExperimentStep.objects.filter(pk=second.pk).update(recorded_at=first.recorded_at + datetime.timedelta(minutes=3))
    data = experiment_comparison(user=owner, ids=[launched.pk, older.pk])
    assert data["runs"][0]["series"]["pass_rate"] == [[1, 1.5, 0.5]]
    assert data["runs"][1]["series"]["pass_rate"] == [[1, 0.0, 0.25], [2, 3.0, 0.5]]


@pytest.mark.django_db
def test_recorded_runs_are_validated(owner, outsider, team):
    with pytest.raises(ValidationError, match="finite"):
        services.experiment_record(owner=owner, name="nan", config={}, steps=[{"step": 1, "loss": float("nan")}])
    with pytest.raises(ValidationError, match="finite"):
        services.experiment_record(owner=owner, name="inf", config={"lr": float("inf")}, steps=[])
    with pytest.raises(ValidationError, match="distinct integer step"):
        services.experiment_record(owner=owner, name="dup", config={}, steps=[{"step": 1}, {"step": 1}])
    with pytest.raises(ValidationError, match="distinct integer step"):
        services.experiment_record(owner=owner, name="bool", config={}, steps=[{"step": True}])
    with pytest.raises(ValidationError, match="at most"):
        services.experiment_record(owner=owner, name="big", config={"x": "y" * 30_000}, steps=[])
    with pytest.raises(ValidationError, match="not a member"):
        services.experiment_record(owner=outsider, name="team", config={}, steps=[], team=team)
    with pytest.raises(ValidationError, match="name"):
        services.experiment_record(owner=owner, name="  ", config={}, steps=[])
    assert not Experiment.objects.exists()
    recorded = services.experiment_record(
        owner=owner, name="ok", config={"recipe": "rft"}, steps=[{"step": 2, "loss": 1.0}],
        checkpoints=[(2, "/tmp/ckpt")],
    )
    assert recorded.status == "finished" and recorded.current_step == 2
    assert list(recorded.checkpoints.values_list("step", flat=True)) == [2]
