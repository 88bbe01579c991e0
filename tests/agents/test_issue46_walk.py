"""Issue 46's walk in Chromium, a screenshot per step (test-results/issue-46/): log in, submit a task,
watch it live, see the verified status, open the API docs (rendered from local assets, not blank).

Follow-ups, branches and the seeded experiment's plots are not part of it yet: they are not built."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.browser import ARTIFACTS, chromium_page, login

pytestmark = pytest.mark.browser

SHOTS = Path(ARTIFACTS) / "issue-46"


def _shot(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


@pytest.mark.django_db(transaction=True)
def test_issue46_walk(owner, demo_repository, asgi_server, celery_worker_process):
    base = f"http://{asgi_server}"
    outside_requests: list[str] = []
    with chromium_page("issue46_walk") as page:
        page.on("request", lambda request: None if request.url.startswith((base, "data:", "blob:"))
                else outside_requests.append(request.url))
        login(page, base, "owner", "owner-pass-123")
        _shot(page, "01-logged-in")

        page.goto(f"{base}/tasks/")
        page.select_option("select[name=repository]", str(demo_repository.pk))
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
        _shot(page, "04-verified")

        page.goto(f"{base}/tasks/traces/?outcome=tests_pass")
        assert page.locator(f"tr[data-task='{task_id}']").count() == 1
        assert "finished, tests pass" in page.locator(f"tr[data-task='{task_id}']").inner_text()
        _shot(page, "05-trace-filter")

        page.goto(f"{base}/api/docs/")
        page.wait_for_selector(".swagger-ui .opblock", timeout=30_000)
        assert page.locator(".swagger-ui .opblock").count() > 5
        assert "Flowstate API" in page.locator(".swagger-ui .title").first.inner_text()
        _shot(page, "06-api-docs")
    assert outside_requests == [], f"the pages asked other hosts for: {outside_requests[:5]}"
