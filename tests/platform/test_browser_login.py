"""A person's first minute: log in through Chromium and see the dashboard and its health table."""

import pytest

from tests.browser import chromium_page, login

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_login_and_see_dashboard(owner, asgi_server):
    base = f"http://{asgi_server}"
    with chromium_page("test_login_and_see_dashboard") as page:
        login(page, base, "owner", "owner-pass-123")
        page.wait_for_url(f"{base}/")
        assert page.locator("h1").inner_text() == "Dashboard"
        for label in ("Tasks", "Experiments", "Traces", "Fleet", "Benchmarks"):
            assert page.locator("header nav").get_by_text(label, exact=True).is_visible()
        # htmx (from the npm build step) loads /healthz and the table fills with every probe.
        page.wait_for_selector("#health-table th:text('database')", timeout=15000)
        names = page.locator("#health-table th").all_inner_texts()
        assert names == ["database", "redis", "celery", "ray", "sandbox_backend"]
        assert page.locator("#health-table tr:has(th:text('database')) td.ok").count() == 1


def test_wrong_password_stays_on_login(owner, asgi_server):
    base = f"http://{asgi_server}"
    with chromium_page("test_wrong_password_stays_on_login") as page:
        login(page, base, "owner", "not-the-password")
        assert "/login/" in page.url
        assert page.locator(".error").is_visible()
