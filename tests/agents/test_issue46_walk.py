"""Issue 46's walk in Chromium, a screenshot per step (test-results/issue-46/, the path is printed): log
in, submit a task, watch it live, see the verified status, send a follow-up and watch the agent continue
in its warm workspace, see the verified status again, create the branch, open the API docs (rendered
from local assets, not blank) and the seeded experiment's plots."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.browser import ARTIFACTS, chromium_page, login

pytestmark = pytest.mark.browser

SHOTS = Path(ARTIFACTS) / "issue-46"


def _shot(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)
    print(f"screenshot: {SHOTS / name}.png")


@pytest.fixture
def short_warm_period(monkeypatch):
    # The worker keeps the finished task's sandbox for a follow-up; short, so its shutdown is quick.
    monkeypatch.setenv("AGENT_FOLLOWUP_WARM_S", "25")


def _gap_below_last_turn(page) -> float:
    """Pixels between the last painted text of the timeline and the result card (a section the browser
    skips painting has an empty innerText: that was the issue's tall empty region)."""
    return page.evaluate("""() => {
        let bottom = 0;
        for (const node of document.querySelectorAll('[data-role=timeline] .turn-header, [data-role=timeline] .ev'))
            if (node.innerText.trim()) bottom = Math.max(bottom, node.getBoundingClientRect().bottom);
        return document.querySelector('[data-role=final]').getBoundingClientRect().top - bottom;
    }""")


def _submit_and_watch_until_verified(page, base: str, repository_pk: int) -> int:
    """Submit a scripted task, watch it run live, and wait for the verified status; its id."""
    page.goto(f"{base}/tasks/")
    page.select_option("select[name=repository]", str(repository_pk))
    page.fill("textarea[name=prompt]", "Fix the failing median test")
    page.select_option("select[name=backend]", "scripted")
    page.fill("input[name=step_delay_s]", "0.5")
    _shot(page, "02-submit-form")
    page.click("#task-form button[type=submit]")
    page.wait_for_url(f"{base}/tasks/*/")
    task_id = int(page.url.rstrip("/").rsplit("/", 1)[-1])

    page.wait_for_function("() => window.flowstateTrace && flowstateTrace.status === 'running' && "
                           "document.querySelectorAll('.ev-tool').length >= 2", timeout=60_000)
    _shot(page, "03-live")

    # The loop stopping is not the verdict: the repository's tests ran after it.
    page.wait_for_function("() => flowstateTrace.status === 'succeeded' && flowstateTrace.outcome === 'tests_pass'",
                           timeout=120_000)
    badge = page.locator("[data-role=status]")
    assert badge.inner_text() == "finished, tests pass"
    verification = page.locator("[data-role=tests]")
    assert "tests pass: 3 passed" in verification.inner_text() and "unittest" in verification.inner_text()
    assert _gap_below_last_turn(page) < 80, "a tall empty region between the last turn and the result"
    _shot(page, "04-verified")
    return task_id


def _follow_up_in_the_warm_workspace(page, base: str, task_id: int) -> None:
    """Send a follow-up; the same conversation continues in the warm workspace and is verified again."""
    page.fill("#followup-message", "Please document median too")
    page.click("[data-role=followup]")
    page.wait_for_url(f"{base}/tasks/{task_id}/")
    page.wait_for_function("() => document.querySelector('.turn-user .user-text') && "
                           "document.querySelector('.turn-user .user-text').textContent === 'Please document median too'",
                           timeout=60_000)
    page.wait_for_function("() => flowstateTrace.status === 'running' || "
                           "document.querySelector('[data-turn=\"result-1\"]')", timeout=60_000)
    _shot(page, "05-followup-live")
    page.wait_for_function("() => flowstateTrace.status === 'succeeded' && flowstateTrace.outcome === 'tests_pass' && "
                           "document.querySelector('[data-turn=\"result-1\"]')", timeout=120_000)
    assert page.locator("[data-role=status]").inner_text() == "finished, tests pass"
    header = page.locator(".turn-user .turn-header").inner_text()
    assert header == "Follow-up from owner · warm workspace", header
    assert page.locator("[data-turn=result-0]").count() == 1  # the first run's result stays in the conversation
    assert _gap_below_last_turn(page) < 80
    _shot(page, "06-followup-verified")


def _branch_trace_filter_and_api_docs(page, base: str, task_id: int) -> None:
    """Create the branch, find the task in the trace filter, open the API docs (local assets)."""
    page.click("[data-role=create-branch]")
    page.wait_for_selector("[data-role=branch-name]")
    assert page.locator("[data-role=branch-name]").inner_text() == f"flowstate/task-{task_id}"
    assert page.locator("[data-role=bundle]").count() == 1
    page.wait_for_function("() => flowstateTrace.events.length > 30 && flowstateTrace.status === 'succeeded'")
    _shot(page, "07-branch")

    page.goto(f"{base}/tasks/traces/?outcome=tests_pass")
    assert page.locator(f"tr[data-task='{task_id}']").count() == 1
    assert "finished, tests pass" in page.locator(f"tr[data-task='{task_id}']").inner_text()
    _shot(page, "08-trace-filter")

    page.goto(f"{base}/api/docs/")
    page.wait_for_selector(".swagger-ui .opblock", timeout=30_000)
    assert page.locator(".swagger-ui .opblock").count() > 5
    assert "Flowstate API" in page.locator(".swagger-ui .title").first.inner_text()
    _shot(page, "09-api-docs")


def _seeded_experiment_pages(page, base: str, experiment_pk: int) -> None:
    """make run's seeded experiment (real scripted rollouts, labelled not trained): its plots render."""
    page.goto(f"{base}/experiments/")
    assert page.locator("fieldset.config-section").count() >= 5
    _shot(page, "10-experiment-form")
    page.goto(f"{base}/experiments/{experiment_pk}/")
    page.wait_for_selector("#chart-mean_reward canvas, #chart-mean_reward svg", timeout=30_000)
    assert "not trained" in page.content()
    _shot(page, "11-seeded-experiment-plots")
    page.goto(f"{base}/experiments/{experiment_pk}/groups/seeded-1/")
    assert page.locator("text=open trace").count() == 2
    _shot(page, "12-seeded-group")


@pytest.mark.django_db(transaction=True)
def test_issue46_walk(owner, demo_repository, short_warm_period, asgi_server, celery_worker_process):
    from webapp.experiments.demo_experiment import demo_experiment_seed
    from webapp.experiments.models import Experiment

    demo_experiment_seed(user=owner)  # what make run seeds (before the browser: the ORM is sync-only)
    experiment = Experiment.objects.get(owner=owner)
    base = f"http://{asgi_server}"
    outside_requests: list[str] = []
    with chromium_page("issue46_walk") as page:
        page.on("request", lambda request: None if request.url.startswith((base, "data:", "blob:"))
                else outside_requests.append(request.url))
        login(page, base, "owner", "owner-pass-123")
        _shot(page, "01-logged-in")
        task_id = _submit_and_watch_until_verified(page, base, demo_repository.pk)
        _follow_up_in_the_warm_workspace(page, base, task_id)
        _branch_trace_filter_and_api_docs(page, base, task_id)
        _seeded_experiment_pages(page, base, experiment.pk)
    assert outside_requests == [], f"the pages asked other hosts for: {outside_requests[:5]}"
