"""The live dashboard in Chromium: ECharts plots fill as the driver's checkpointed steps are ingested."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.browser import chromium_page, login
from webapp.experiments import services
from webapp.experiments.models import Experiment

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _step(step: int) -> dict:
    # One line of the driver's metrics.jsonl (training.rollout.driver writes exactly these keys).
    return {
        "step": step,
        "rollouts": 4,
        "valid_rollouts": 4,
        "masked_rollouts": 0,
        "mean_reward": 0.25 * step,
        "pass_rate": 0.25 * step,
        "mean_completion_tokens": 100.0 + step,
        "mean_turns": 2.0,
        "tool_calls_per_turn": 1.5,
        "parallel_call_share": 0.5,
        "staleness_mean": 0.5,
        "staleness_max": 1,
        "rollouts_per_s": 0.2,
        "worker_utilization": 0.9,
        "dropped_stale_total": 0,
        "failed_rollouts_total": 0,
        "stage_seconds": {"sandbox": 0.2, "agent": 3.0, "reward": 0.3, "update": 1.0},
    }


def _ingest(experiment: Experiment) -> int:
    from django.db import connection

    try:
        return services.experiment_ingest(experiment=experiment)
    finally:
        connection.close()


def test_dashboard_plots_update_live(owner, asgi_server, tmp_path):
    run_dir = tmp_path / "run"
    experiment = Experiment.objects.create(
        owner=owner, name="browser", config={"steps": 2}, status="running", run_dir=str(run_dir)
    )
    base = f"http://{asgi_server}"
    with chromium_page("test_dashboard_plots_update_live") as page:
        login(page, base, "owner", "owner-pass-123")
        page.wait_for_url(f"{base}/")
        page.goto(f"{base}/experiments/{experiment.pk}/")
        page.wait_for_function("window.flowstateExperimentSeries !== undefined", timeout=15000)
        assert page.locator("#charts canvas").count() >= 9
        page.wait_for_timeout(1000)  # the websocket snapshot has arrived; the plots are empty

        (run_dir / "checkpoints" / "step-00000002").mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(_step(step)) + "\n" for step in (1, 2)))
        # Playwright's sync API runs an event loop in this thread, so the ORM call goes to another one.
        with ThreadPoolExecutor(max_workers=1) as pool:
            assert pool.submit(_ingest, experiment).result(timeout=60) == 2

        page.wait_for_function("window.flowstateExperimentSeries.mean_reward.length === 2", timeout=15000)
        assert page.locator("#current-step").inner_text() == "2"
        points = page.evaluate("window.flowstateExperimentSeries.pass_rate")
        assert points == [[1, 0.25], [2, 0.5]]
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        assert sorted(page.evaluate("Object.keys(window.flowstateExperimentSeries.stage_seconds)")) == [
            "agent",
            "reward",
            "sandbox",
            "update",
        ]
