"""make run's seeded experiment: real rollouts of scripted policies on toy tasks, labelled as not trained."""

from __future__ import annotations

import pytest
from django.test import Client

from webapp.experiments.demo_experiment import DEMO_EXPERIMENT_NAME, GROUP_SIZE, STEPS, demo_experiment_seed
from webapp.experiments.models import Experiment, ExperimentRollout

pytestmark = pytest.mark.django_db


def test_the_seeded_experiment_has_real_rollouts_and_says_it_was_not_trained(owner, teammate):
    summary = demo_experiment_seed(user=owner)
    experiment = Experiment.objects.get(owner=owner, name=DEMO_EXPERIMENT_NAME)
    assert "not trained" in summary and "not trained" in experiment.status_reason and "seeded" in experiment.name
    assert experiment.status == "finished" and experiment.steps.count() == STEPS
    rollouts = ExperimentRollout.objects.filter(experiment=experiment)
    assert rollouts.count() == STEPS * GROUP_SIZE
    # The reference fix passes the hidden tests, giving up does not: measured, not written in.
    assert sorted({(r.sample_index, r.passed) for r in rollouts}) == [(0, True), (1, False)]
    assert all(r.trace is not None and r.trace.events.filter(kind="final").exists() for r in rollouts)
    assert {s.metrics["pass_rate"] for s in experiment.steps.all()} == {0.5}
    assert demo_experiment_seed(user=owner).endswith("already present")

    client = Client()
    client.force_login(teammate)  # shared with the owner's team: the dashboard and group view are visible
    assert client.get(f"/experiments/{experiment.pk}/").status_code == 200
    page = client.get(f"/experiments/{experiment.pk}/groups/seeded-1/")
    trace_id = rollouts.get(rollout_id="seeded-1-0").trace_id
    assert page.status_code == 200 and f"/tasks/{trace_id}/" in page.content.decode()
