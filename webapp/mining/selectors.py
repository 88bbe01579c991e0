"""Reads of the mining app: task sets and their tasks for their owner and teammates only."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator

from django.db.models import Count, QuerySet

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


def task_set_choices(*, user, split: str | None = None) -> list[tuple[int, str]]:
    """(id, label) of the ready task sets the user may see (with tasks of ``split`` when given), newest first:
    the menus of the experiment form and the benchmark forms."""
    sets = task_set_list(user=user).filter(status=TaskSet.Status.READY).annotate(count=Count("tasks", distinct=True))
    if split is not None:
        sets = sets.filter(tasks__split=split).distinct()
    labels = []
    for task_set in sets.order_by("-created_at", "-id")[:200]:
        labels.append((task_set.pk, f"{task_set.name} (#{task_set.pk}, {task_set.repo_label}, {task_set.count} tasks)"))
    return labels


def task_set_suite_choices(*, user) -> list[tuple[str, str]]:
    """(suite, label) of the held-out and train suites of the ready task sets the user may see."""
    choices = []
    for split in ("heldout", "train"):
        for pk, label in task_set_choices(user=user, split=split):
            choices.append((f"taskset-{pk}-{split}", f"{label}: {'held-out' if split == 'heldout' else 'train'}"))
    return choices


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
