"""Task sets are chosen from menus of the sets the user may see: the experiment form's task source, a
checkpoint's evaluation and the leaderboard's benchmark form (owner, teammate, outsider)."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

pytestmark = pytest.mark.django_db


def _options(page: str, name: str) -> list[str]:
    select = re.search(rf'<select name="{name}"[^>]*>(.*?)</select>', page, re.S)
    assert select, f"no <select name={name!r}> on the page"
    return re.findall(r'<option value="([^"]*)"', select.group(1))


def test_experiment_form_offers_visible_sets_with_train_tasks(shared_set, owner, teammate, outsider, client,
                                                              django_capture_on_commit_callbacks, policy_checkpoint):
    from webapp.experiments.models import Experiment
    from webapp.mining.models import TaskSet

    _, task_set = shared_set
    heldout_only = TaskSet.objects.create(owner=owner, team=task_set.team, name="no train", repo_label="calc",
                                          repo_location="/x", status=TaskSet.Status.READY)
    heldout_only.tasks.create(task_id="h", split="heldout", source="mutation", path="a.py", kind="k", prompt="p",
                              diff="", task=task_set.tasks.get(split="heldout").task)
    TaskSet.objects.create(owner=owner, name="still mining", repo_label="calc", repo_location="/x")
    for user, visible in ((owner, True), (teammate, True), (outsider, False)):
        client.force_login(user)
        page = client.get(reverse("experiments:experiment-list")).content.decode()
        assert _options(page, "task_set") == (["", str(task_set.pk)] if visible else [""])
        assert (f"shared (#{task_set.pk}, calc, 2 tasks)" in page) == visible
    # An id typed past the menu is refused by the form; nothing is created.
    client.force_login(outsider)
    response = client.post(reverse("experiments:experiment-list"), {
        "name": "theirs", "task_set": task_set.pk, "tasks": 4, "steps": 1, "init_checkpoint": policy_checkpoint})
    assert response.status_code == 400 and "Select a valid choice" in response.content.decode()
    assert not Experiment.objects.filter(name="theirs").exists()
    client.force_login(teammate)
    with django_capture_on_commit_callbacks(execute=False):
        response = client.post(reverse("experiments:experiment-list"), {
            "name": "ours", "task_set": task_set.pk, "tasks": 4, "steps": 1, "init_checkpoint": policy_checkpoint})
    assert response.status_code == 302, response.content.decode()[-2000:]
    assert Experiment.objects.get(name="ours").config["task_set"] == task_set.pk


def test_leaderboard_benchmark_form_offers_visible_set_suites(shared_set, owner, teammate, outsider, client,
                                                              django_capture_on_commit_callbacks):
    from webapp.experiments.models import BenchmarkRun

    _, task_set = shared_set
    suites = [task_set.suite("heldout"), task_set.suite("train")]
    for user, visible in ((owner, True), (teammate, True), (outsider, False)):
        client.force_login(user)
        page = client.get(reverse("experiments:benchmarks")).content.decode()
        if visible:
            run_form = page[page.index('id="benchmark-run"'):]
            assert _options(run_form, "suite") == suites and _options(run_form, "policy")[0] == "scripted"
            assert set(suites) <= set(_options(page, "suite"))  # the leaderboard's filter lists the set's tiers
        else:
            assert task_set.suite("heldout") not in page and 'id="benchmark-run"' not in page
        with django_capture_on_commit_callbacks(execute=False) as queued:
            response = client.post(reverse("experiments:benchmark-run"), {
                "suite": task_set.suite("heldout"), "policy": "scripted", "attempts": 1}, follow=True)
        assert response.redirect_chain[-1][0] == reverse("experiments:benchmarks")
        made = BenchmarkRun.objects.filter(owner=user, suite=task_set.suite("heldout"))
        assert made.exists() == visible and len(queued) == int(visible)
    # A policy outside the menu (a server path) is refused.
    client.force_login(owner)
    client.post(reverse("experiments:benchmark-run"), {"suite": suites[0], "policy": "checkpoint:/etc", "attempts": 1})
    assert not BenchmarkRun.objects.filter(summary__policy="checkpoint:/etc").exists()


def test_checkpoint_evaluation_takes_a_task_set_from_its_menu(shared_set, owner, outsider, tmp_path):
    from webapp.experiments.forms import EvaluateForm

    _, task_set = shared_set
    form = EvaluateForm({"suite": "", "task_set_suite": task_set.suite("train"), "attempts": 1}, user=owner)
    assert form.is_valid(), form.errors
    assert form.cleaned_data["suite"] == task_set.suite("train")
    assert EvaluateForm({"suite": "toy-heldout-5", "task_set_suite": "", "attempts": 1}, user=owner).is_valid()
    theirs = EvaluateForm({"suite": "", "task_set_suite": task_set.suite("train"), "attempts": 1}, user=outsider)
    assert not theirs.is_valid() and "task_set_suite" in theirs.errors
    assert not EvaluateForm({"suite": "", "task_set_suite": "", "attempts": 1}, user=owner).is_valid()
