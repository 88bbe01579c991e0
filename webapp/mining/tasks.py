"""Celery jobs of the mining app (queue "maintenance"): they call one service each."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="mining.repository_setup", acks_late=True, reject_on_worker_lost=True)
def repository_setup_task(repository_id: int) -> str:
    from webapp.agents.models import Repository
    from webapp.mining.services import repository_setup_run

    recipe = repository_setup_run(repository=Repository.objects.get(pk=int(repository_id)))
    return f"repository {repository_id}: {recipe.status}"


@shared_task(name="mining.task_set_mine", acks_late=True, reject_on_worker_lost=True)
def task_set_mine_task(task_set_id: int) -> str:
    from webapp.mining.services import task_set_mine

    task_set = task_set_mine(task_set_id=int(task_set_id))
    return f"task set {task_set_id}: {task_set.status}"
