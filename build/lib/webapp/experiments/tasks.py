"""Celery entry points of the experiments app: parse, call one service, return its note."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="experiments.monitor", acks_late=True, reject_on_worker_lost=True)
def experiment_monitor_task(experiment_id: int) -> str:
    from webapp.experiments.services import experiment_monitor

    return experiment_monitor(experiment_id=int(experiment_id))


@shared_task(name="experiments.benchmark_run", acks_late=True, reject_on_worker_lost=True)
def benchmark_run_task(run_id: int) -> str:
    from webapp.experiments.services import benchmark_run_execute

    run = benchmark_run_execute(run_id=int(run_id))
    return f"benchmark run {run.pk}: {run.status}"


@shared_task(name="experiments.repository_recipe_detect", acks_late=True, reject_on_worker_lost=True)
def repository_recipe_detect_task(repository_id: int) -> str:
    from webapp.agents.models import Repository
    from webapp.experiments.services import repository_recipe_detect

    recipe = repository_recipe_detect(repository=Repository.objects.get(pk=int(repository_id)))
    return f"repository {repository_id}: {recipe.status}"
