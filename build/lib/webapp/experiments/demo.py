"""Demo data for `make run`: one real benchmark run (the scripted reference fix) on the leaderboard."""

from __future__ import annotations

from webapp.experiments.models import BenchmarkRun
from webapp.experiments.services import benchmark_run_create, benchmark_run_execute

DEMO_SUITE = "toy-heldout-5"


def demo_seed(*, user) -> str:
    """Idempotent: runs the scripted upper bound on a small held-out suite once (a few seconds)."""
    existing = BenchmarkRun.objects.filter(
        owner=user, suite=DEMO_SUITE, policy_kind=BenchmarkRun.PolicyKind.SCRIPTED, status=BenchmarkRun.Status.FINISHED
    ).first()
    if existing is not None:
        return f"benchmark run {existing.pk} on {DEMO_SUITE} already present"
    run = benchmark_run_create(
        owner=user, team=user.teams.first(), suite=DEMO_SUITE, policy="scripted", attempts=1, enqueue=False
    )
    run = benchmark_run_execute(run_id=run.pk)
    return f"benchmark run {run.pk} on {DEMO_SUITE}: pass@1 {run.summary.get('pass_at_1')}"
