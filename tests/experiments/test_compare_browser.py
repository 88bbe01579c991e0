"""The comparison view in Chromium: tick two experiments in the list, press compare, see two series."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.browser import chromium_page, login
from webapp.experiments import services

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _record(owner) -> list[int]:
    from django.db import connection

    try:
        ids = []
        for name, lr, slope in (("rl-run", 3e-5, 0.1), ("sft-run", 5e-4, 0.05)):
            steps = [{"step": step, "pass_rate": slope * step, "minutes": 1.5 * step} for step in range(1, 5)]
            ids.append(services.experiment_record(owner=owner, name=name, config={"lr": lr}, steps=steps).pk)
        return ids
    finally:
        connection.close()


def test_select_two_runs_and_see_two_series(owner, asgi_server, tmp_path):
    # Playwright's sync API runs an event loop in this thread, so the ORM call goes to another one.
    with ThreadPoolExecutor(max_workers=1) as pool:
        first, second = pool.submit(_record, owner).result(timeout=60)
    base = f"http://{asgi_server}"
    with chromium_page("test_select_two_runs_and_see_two_series") as page:
        login(page, base, "owner", "owner-pass-123")
        page.wait_for_url(f"{base}/")
        page.goto(f"{base}/experiments/")
        page.check(f'input[name="ids"][value="{first}"]')
        page.check(f'input[name="ids"][value="{second}"]')
        page.click("#compare-button")
        page.wait_for_url(f"{base}/experiments/compare/**")
        page.wait_for_function("window.flowstateCompareCharts && window.flowstateCompareCharts.pass_rate", timeout=15000)
        names = page.evaluate("window.flowstateCompareCharts.pass_rate.getOption().series.map((s) => s.name)")
        assert names == [f"#{first} rl-run", f"#{second} sft-run"]
        assert page.evaluate("window.flowstateCompareCharts.pass_rate.getOption().series[0].data[3]") == [4, 0.4]
        assert page.locator("#compare-charts canvas").count() >= 1
        page.select_option("#x-axis", "minutes")
        assert page.evaluate("window.flowstateCompareCharts.pass_rate.getOption().series[1].data[3]") == [6, 0.2]
        assert page.evaluate("window.flowstateCompareCharts.pass_rate.getOption().xAxis[0].name") == "minutes"
        assert "lr" in page.locator("#config-differences").inner_text()
        page.screenshot(path=str(tmp_path / "compare.png"), full_page=True)
