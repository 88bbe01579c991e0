"""Playwright helpers: Debian's Chromium, headless, with a screenshot saved when a test fails."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-results"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@contextlib.contextmanager
def chromium_page(test_name: str):
    """Yield a Playwright page; on an exception save a full-page screenshot, then re-raise."""
    if not Path(CHROMIUM).exists():
        pytest.skip("Chromium is not installed (apt-get install chromium); .ci/run installs it")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        try:
            yield page
        except BaseException:
            ARTIFACTS.mkdir(exist_ok=True)
            shot = ARTIFACTS / f"{test_name}.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"screenshot of the failure: {shot}")
            raise
        finally:
            browser.close()


def login(page, base_url: str, username: str, password: str) -> None:
    page.goto(f"{base_url}/login/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", password)
    page.click("button[type=submit]")


def console_error(errors: list[str], message) -> None:
    """Collect a page's console errors; the browser's own favicon request (the app serves none) is not one."""
    if message.type == "error" and not (message.location or {}).get("url", "").endswith("/favicon.ico"):
        errors.append(f"{message.text} ({(message.location or {}).get('url', '')})")


def submit_scripted_task(page, base_url: str, repository_pk: int, *, step_delay_s: float) -> int:
    """Submit the demo prompt with the scripted backend through the task form; returns the new task's id."""
    page.goto(f"{base_url}/tasks/")
    page.select_option("select[name=repository]", str(repository_pk))
    page.fill("textarea[name=prompt]", "Fix the failing median test")
    page.select_option("select[name=backend]", "scripted")
    page.fill("input[name=step_delay_s]", str(step_delay_s))
    page.click("#task-form button[type=submit]")
    page.wait_for_url(f"{base_url}/tasks/*/")
    return int(page.url.rstrip("/").rsplit("/", 1)[-1])
