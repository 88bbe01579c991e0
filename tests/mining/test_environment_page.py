"""The environment page as its owner uses it in Chromium: "Detect and set up" submits with an empty test
command, the page follows the setup live to its end (no reload), a failure is said in words with the
next thing to try, a recipe that cannot be saved comes back with what was typed; the task-set page's
counts agree and a finished set offers no Cancel."""

from __future__ import annotations

import pytest

from tests.browser import chromium_page, console_error, login
from tests.mining.conftest import build_small_repository

pytestmark = pytest.mark.browser


@pytest.fixture
def offline_setup(monkeypatch):
    # The worker child process reads these: setup runs offline and a test run is short.
    monkeypatch.setenv("REPO_SETUP_NETWORK", "0")
    monkeypatch.setenv("REPO_TEST_TIMEOUT_S", "60")


def _status(page) -> str:
    return page.locator("[data-role=env-status]").inner_text()


@pytest.mark.django_db(transaction=True)
def test_detect_follow_live_fail_in_words_and_keep_input(owner, tmp_path, offline_setup, asgi_server,
                                                         celery_worker_process):
    from webapp.agents.models import Repository

    root = build_small_repository(tmp_path / "calc")
    repository = Repository.objects.create(owner=owner, name="calc", kind="path", location=str(root))
    base = f"http://{asgi_server}"
    errors: list[str] = []
    with chromium_page("mining_environment") as page:
        page.set_default_timeout(60_000)
        page.on("console", lambda message: console_error(errors, message))
        page.on("pageerror", lambda error: errors.append(str(error)))
        login(page, base, "owner", "owner-pass-123")
        page.goto(f"{base}/mining/repositories/{repository.pk}/")
        assert _status(page) == "not set up"
        assert page.locator("input[name=test_command]").input_value() == ""
        page.click("[data-role=detect]")  # the browser must not block it: the field is what detection fills
        page.wait_for_url(f"{base}/mining/repositories/{repository.pk}/")
        assert "Setup queued (detecting the recipe)." in page.locator("main").inner_text() or _status(page) != "pending"
        page.wait_for_function("() => document.querySelector('[data-role=env-status]').textContent === 'ready'",
                               timeout=180_000)
        assert page.locator("[data-role=env-progress]").is_hidden()
        assert page.locator("[data-role=mine-card]").is_visible()  # offered once ready, without a reload
        assert "passing" in page.locator("[data-role=env-baseline]").inner_text()

        # A recipe whose command runs no tests: the failure comes live, in words, with the next step.
        page.fill("input[name=test_command]", "python3 -m unittest -v tests.test_missing")
        page.select_option("select[name=runner]", "unittest")
        page.click("[data-role=save-recipe]")
        page.wait_for_function("() => document.querySelector('[data-role=env-status]').textContent === 'failed'",
                               timeout=180_000)
        failure = page.locator("[data-role=env-failure]").inner_text()
        assert failure.startswith("Setup failed at the test step:"), failure
        assert "{" not in failure and "'" not in failure.split(":", 1)[1][:3]
        assert "edit the test command" in page.locator("[data-role=env-next]").inner_text()
        assert "test_missing" in page.locator("[data-role=env-log]").inner_text()
        assert page.locator("[data-role=mine-card]").is_hidden()

        assert errors == [], errors
        # Saving without a test command: refused (400) with the reason, the typed setup commands kept.
        page.fill("textarea[name=setup_commands]", "echo kept")
        page.fill("input[name=test_command]", "")
        page.click("[data-role=save-recipe]")
        assert "give the command that runs the tests" in page.locator("#recipe").inner_text()
        assert page.locator("textarea[name=setup_commands]").input_value() == "echo kept"
    assert [e for e in errors if "status of 400" not in e] == [], errors


def test_task_set_counts_agree_and_a_failed_set_offers_no_cancel(owner, client):
    from webapp.mining.models import TaskSet

    task_set = TaskSet.objects.create(
        owner=owner, name="s", repo_label="calc", repo_location="/x", status=TaskSet.Status.FAILED,
        status_reason="no candidate validated (12 tried; rejected: the tests hang with the bug (12))",
        progress={"phase": "validating", "tried": 11, "validated": 0},
        stats={"tried": 12, "validated": 0, "rejected": {"the tests hang with the bug": 12}})
    client.force_login(owner)
    page = client.get(f"/mining/sets/{task_set.pk}/").content.decode()
    assert "12 candidates tried" in page and "11 candidates tried" not in page
    assert "the tests hang with the bug (12)" in page and "{" not in page.split('id="progress"')[1].split("</div>")[0]
    assert "Mine again with more candidates" in page
    assert 'data-role="cancel"' not in page and "hx-trigger" not in page
    TaskSet.objects.filter(pk=task_set.pk).update(status=TaskSet.Status.RUNNING)
    fragment = client.get(f"/mining/sets/{task_set.pk}/progress/").content.decode()
    assert 'data-role="cancel"' in fragment and "hx-trigger" in fragment
