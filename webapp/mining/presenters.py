"""What the environment and task-set pages (and their JSON) say about a setup or mining run, in words.

A failure names what went wrong and the next thing to try; counters come from one place (the finished
run's figures once there are any, else the live progress), so two parts of a page never disagree.
"""

from __future__ import annotations

from django.utils import timezone

NEXT_STEP = {
    "detect": "Write the recipe yourself below (setup commands and a test command), then press "
              "\"Save recipe and set up\".",
    "install": "Open the setup log to see the failing command, fix the setup commands (or raise the setup "
               "budget) and save the recipe.",
    "test": "Check that the test command runs the suite from the repository root and that the tests pass on a "
            "clean checkout; edit the test command and save the recipe.",
}
"""The next thing to try after a setup failure, by the stage that failed."""

STEP_WHEN = {"pending": "waiting for a worker to start the setup", "running": "starting"}

LOG_TAIL_CHARS = 4000


def rejected_text(rejected: dict | None) -> str:
    """``{"the tests hang with the bug": 3}`` as "the tests hang with the bug (3)", most frequent first."""
    parts = [f"{str(reason).replace('_', ' ')} ({count})"
             for reason, count in sorted((rejected or {}).items(), key=lambda item: -int(item[1] or 0))]
    return "; ".join(parts)


def environment_state(recipe) -> dict:
    """The environment of one repository as its page and the API show it (``recipe`` may be None)."""
    if recipe is None:
        return {"status": "not set up", "active": False, "step": "", "elapsed_s": None, "failure": "",
                "next_step": "Press \"Detect and set up\": the recipe is detected from the repository's files.",
                "log_tail": "", "baseline": ""}
    active = recipe.status in ("pending", "running")
    failure = recipe.failure or {}
    stage = str(failure.get("stage") or "")
    baseline = (recipe.recipe or {}).get("baseline") or {}
    return {
        "status": recipe.status,
        "active": active,
        "step": (recipe.step or STEP_WHEN.get(recipe.status, "")) if active else "",
        "elapsed_s": round((timezone.now() - recipe.updated_at).total_seconds(), 1) if active else None,
        "failure": f"Setup failed at the {stage} step: {failure.get('reason', '')}" if stage else "",
        "next_step": NEXT_STEP.get(stage, "") if stage else "",
        "log_tail": (recipe.log or "")[-LOG_TAIL_CHARS:],
        "baseline": (f"{len(baseline.get('passed') or ())} passing, {len(baseline.get('failed') or ())} failing, "
                     f"{len(baseline.get('errored') or ())} erroring tests; suite {baseline.get('duration_s')} s")
        if baseline and recipe.status == "ready" else "",
    }


def task_set_counts(task_set) -> dict:
    """Candidates tried and validated: the finished run's figures once stored, else the live progress."""
    source = task_set.stats or task_set.progress or {}
    return {"tried": int(source.get("tried") or 0), "validated": int(source.get("validated") or 0),
            "rejected": rejected_text(source.get("rejected"))}


def task_set_next_step(task_set) -> str:
    """After a failed mining run: what to change before mining again."""
    if task_set.status != "failed":
        return ""
    reason = task_set.status_reason or ""
    if reason.startswith("setup failed"):
        return "Open the repository's environment page, fix its recipe there and mine again."
    if reason.startswith("no candidate validated"):
        return ("Mine again with more candidates or more history commits, or with the selection that runs the whole "
                "suite; a repository whose tests do not exercise its code yields few tasks.")
    return "Mine again; if it fails the same way, check the repository's environment page."


def task_set_elapsed_s(task_set) -> float | None:
    """Seconds the mining job has run (so far, or in all once finished); None before it started."""
    if task_set.started_at is None:
        return None
    return round(((task_set.finished_at or timezone.now()) - task_set.started_at).total_seconds(), 1)
