"""Reads of the mining app: task sets and their tasks for their owner and teammates only."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator

from django.db.models import QuerySet

from webapp.core.selectors import owned_get_for_change, owned_get_visible, owned_visible_to
from webapp.experiments.models import BenchmarkRun, BenchmarkTaskResult, RepositoryRecipe
from webapp.mining.models import MinedTask, TaskSet


def task_set_list(*, user) -> QuerySet[TaskSet]:
    return owned_visible_to(queryset=TaskSet.objects.select_related("owner", "team"), user=user)


def task_set_get(*, user, pk) -> TaskSet:
    return owned_get_visible(queryset=TaskSet.objects.select_related("owner", "team", "repository"), user=user, pk=pk)


def task_set_get_for_change(*, user, pk) -> TaskSet:
    return owned_get_for_change(queryset=TaskSet.objects.all(), user=user, pk=pk)


def task_set_ready_get(*, user, pk) -> TaskSet | None:
    """A ready task set the user may see, or None."""
    return task_set_list(user=user).filter(pk=pk, status=TaskSet.Status.READY).first()


def mined_task_get(*, task_set: TaskSet, pk) -> MinedTask:
    from django.http import Http404

    try:
        return task_set.tasks.get(pk=pk)
    except MinedTask.DoesNotExist:
        raise Http404 from None


def repository_recipe(*, repository) -> RepositoryRecipe | None:
    return RepositoryRecipe.objects.filter(repository=repository).first()


def task_set_solve_rates(*, user, task_set: TaskSet) -> dict[str, dict[str, float]]:
    """task_id -> {policy label: pass rate} from the finished benchmark runs on the set the user can see."""
    runs = owned_visible_to(queryset=BenchmarkRun.objects.all(), user=user).filter(
        suite__in=[task_set.suite("train"), task_set.suite("heldout")], status=BenchmarkRun.Status.FINISHED)
    rates: dict[str, dict[str, float]] = defaultdict(dict)
    for row in BenchmarkTaskResult.objects.filter(run__in=runs).select_related("run").order_by("run__created_at"):
        if row.attempts:
            rates[row.task_id][row.run.policy_label or row.run.policy_kind] = row.passes / row.attempts
    return dict(rates)


def task_set_export_lines(*, task_set: TaskSet, split: str | None = None) -> Iterator[str]:
    """JSON lines: one CodingTask per line, with the set's provenance under metadata.task_set."""
    provenance = {"task_set": task_set.pk, "name": task_set.name, "repository": task_set.repo_label,
                  "location": task_set.repo_location, "commit": task_set.commit, "recipe": task_set.recipe,
                  "settings": task_set.settings}
    rows = task_set.tasks.all() if split is None else task_set.tasks.filter(split=split)
    for row in rows.order_by("id").iterator():
        task = dict(row.task)
        task["metadata"] = {**task.get("metadata", {}), "task_set": provenance, "expert_solved": row.expert_solved}
        yield json.dumps(task, sort_keys=True) + "\n"
