"""Demo data for `make run`: a demo repository with a failing test and one finished task on it."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings

from training.agent.demo_repo import DEMO_PROMPT, write_demo_repository
from webapp.agents.models import AgentTask, Repository
from webapp.agents.services import repository_create, task_create, task_run

DEMO_REPOSITORY_NAME = "stats-demo"


def demo_seed(*, user) -> str:
    """Idempotent: creates what is missing and returns a one-line summary."""
    team = user.teams.first()
    path = write_demo_repository(Path(settings.STATE_DIR) / "demo" / "stats-demo")
    repository = Repository.objects.filter(owner=user, name=DEMO_REPOSITORY_NAME).first()
    if repository is None:
        repository = repository_create(
            owner=user, team=team, name=DEMO_REPOSITORY_NAME, kind=Repository.Kind.PATH, location=str(path),
            description="A tiny Python package whose median() is wrong for even-length lists.", allow_server_path=True,
        )
    finished = AgentTask.objects.filter(owner=user, repository=repository, status=AgentTask.Status.SUCCEEDED).first()
    if finished is None:
        task = task_create(owner=user, team=team, repository=repository, prompt=DEMO_PROMPT,
                           backend=str(AgentTask.Backend.SCRIPTED), enqueue=False)
        outcome = task_run(task_id=task.pk)
        task.refresh_from_db()
        return f"repository '{repository.name}' at {path}; demo task {task.pk}: {outcome}; {task.verdict}"
    return f"repository '{repository.name}' at {path}; demo task {finished.pk} already present"
