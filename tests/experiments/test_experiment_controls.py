"""The experiment page offers only the controls its state accepts, and keeps them current live; the API
answers 409 to an action the state forbids (cancel after cancel, pause or resume of a finished run)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.browser import chromium_page, console_error, login

pytestmark = pytest.mark.browser

CONTROLS = ("pause", "resume", "cancel")


def _in_thread(function):
    """Run ORM code beside the browser (Playwright's sync API keeps an event loop in this thread)."""
    from django.db import connection

    def run():
        try:
            return function()
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result(timeout=60)


def _shown(page) -> list[str]:
    return [name for name in CONTROLS if page.locator(f".controls [data-role={name}]").is_visible()]


def test_cancel_after_cancel_and_actions_on_a_finished_run_are_conflicts(owner, api_client_for, tmp_path):
    from webapp.experiments.models import Experiment

    experiment = Experiment.objects.create(owner=owner, name="c", config={"steps": 2}, run_dir=str(tmp_path),
                                           status=Experiment.Status.RUNNING)
    api = api_client_for(owner)
    first = api.post(f"/api/experiments/{experiment.pk}/cancel/")
    assert first.status_code == 200 and first.json()["status"] == "running"  # the driver stops at its next step
    again = api.post(f"/api/experiments/{experiment.pk}/cancel/")
    assert again.status_code == 409 and "already requested" in again.content.decode()
    Experiment.objects.filter(pk=experiment.pk).update(status=Experiment.Status.CANCELLED)
    for action in CONTROLS:
        assert api.post(f"/api/experiments/{experiment.pk}/{action}/").status_code == 409, action
    Experiment.objects.filter(pk=experiment.pk).update(status=Experiment.Status.RUNNING, pause_requested=True)
    assert api.post(f"/api/experiments/{experiment.pk}/pause/").status_code == 409  # already requested


@pytest.mark.django_db(transaction=True)
def test_controls_follow_the_status_live(owner, asgi_server, api_client_for, tmp_path):
    from webapp.experiments.events import experiment_publish, experiment_status_message
    from webapp.experiments.models import Experiment

    experiment = Experiment.objects.create(owner=owner, name="live controls", config={"steps": 2},
                                           run_dir=str(tmp_path), status=Experiment.Status.RUNNING)
    url = f"/api/experiments/{experiment.pk}/cancel/"
    base = f"http://{asgi_server}"
    errors: list[str] = []

    def driver_stops() -> None:
        Experiment.objects.filter(pk=experiment.pk).update(status=Experiment.Status.CANCELLED,
                                                           status_reason="cancelled")
        experiment_publish(Experiment.objects.get(pk=experiment.pk),
                           experiment_status_message(Experiment.objects.get(pk=experiment.pk)))

    with chromium_page("experiment_controls") as page:
        page.on("console", lambda message: console_error(errors, message))
        page.on("pageerror", lambda error: errors.append(str(error)))
        login(page, base, "owner", "owner-pass-123")
        page.goto(f"{base}/experiments/{experiment.pk}/")
        assert _shown(page) == ["pause", "cancel"]
        assert _in_thread(lambda: api_client_for(owner).post(url).status_code) == 200
        assert _in_thread(lambda: api_client_for(owner).post(url).status_code) == 409
        _in_thread(driver_stops)
        page.wait_for_function("() => document.getElementById('experiment-status').textContent === 'cancelled'",
                               timeout=30_000)
        assert _shown(page) == [], "a cancelled run still offers controls"
        page.reload()
        assert _shown(page) == []
    assert _in_thread(lambda: api_client_for(owner).post(url).status_code) == 409
    assert _in_thread(lambda: Experiment.objects.get(pk=experiment.pk).status) == "cancelled"
    assert errors == [], errors
