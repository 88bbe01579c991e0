"""Trace view with 5,000 events in headless Chromium: time to a usable page, lazy vs eager rendering.

A recorded run of 5,002 events (1,250 turns) is stored with ``rollout_record``; the detail page
loads the events over the REST API and renders only the turns near the viewport. Measured:

* load: navigation -> every event fetched and the visible turns drawn (the product's lazy path);
* baseline (same run): the same page after forcing every turn body to render (what an eager
  renderer would have to do), timed from the same start;
* DOM size of both, and the time a scroll to the end takes to show the last turn.

Needs PostgreSQL and Redis like bench_events.py. Run:  .venv/bin/python benchmarks/bench_events_render.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench_events


def main() -> int:
    import django

    django.setup()
    bench_events.ensure_database()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from django.contrib.auth import get_user_model
    from playwright.sync_api import sync_playwright

    from tests.agents.test_browser import _long_trace_result
    from tests.browser import CHROMIUM, CHROMIUM_ARGS
    from webapp.accounts.services import user_create
    from webapp.agents.services import rollout_record

    username, password = "bench-render", "bench-render-pass"
    user = get_user_model().objects.filter(username=username).first() or user_create(username=username, password=password)
    task = rollout_record(owner=user, result=_long_trace_result(1250), prompt="render benchmark", experiment_name="bench",
                          repo_label="long", model_name="recorded")
    port = bench_events.free_port()
    server = bench_events.start_server(port)
    base = f"http://127.0.0.1:{port}"
    lazy, eager, scroll = [], [], []
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{base}/login/")
            page.fill("input[name=username]", username)
            page.fill("input[name=password]", password)
            page.click("button[type=submit]")
            page.wait_for_url(f"{base}/")
            for _ in range(5):
                started = time.perf_counter()
                page.goto(f"{base}/tasks/{task.pk}/")
                page.wait_for_function("() => window.flowstateTrace && flowstateTrace.events.length === 5002 && "
                                       "document.querySelector('.ev-tool') !== null", timeout=120_000, polling=10)
                lazy.append(time.perf_counter() - started)
                lazy_nodes = page.evaluate("document.getElementsByTagName('*').length")
                began = time.perf_counter()
                page.evaluate("() => { for (const key of flowstateTrace.turns.keys()) flowstateTrace.renderTurnBody(key); "
                              "return document.body.offsetHeight; }")
                eager.append(lazy[-1] + time.perf_counter() - began)
                eager_nodes = page.evaluate("document.getElementsByTagName('*').length")
                page.goto(f"{base}/tasks/{task.pk}/")
                page.wait_for_function("() => window.flowstateTrace && flowstateTrace.events.length === 5002", timeout=120_000)
                began = time.perf_counter()
                page.locator("section.turn[data-turn='1250']").scroll_into_view_if_needed()
                page.wait_for_function("() => document.querySelector(\"section.turn[data-turn='1250'] .ev-tool\") !== null",
                                       polling=10)
                scroll.append(time.perf_counter() - began)
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=15)
    median = statistics.median
    print(f"trace with 5002 events, {len(lazy)} loads each")
    print(f"lazy (product) load to usable page     median {median(lazy) * 1000:7.0f} ms   DOM nodes {lazy_nodes}")
    print(f"eager baseline (every turn rendered)   median {median(eager) * 1000:7.0f} ms   DOM nodes {eager_nodes}")
    print(f"ratio lazy / eager: {median(lazy) / median(eager):.2f}x time, {lazy_nodes / eager_nodes:.2f}x DOM nodes")
    print(f"scroll to the last turn until drawn    median {median(scroll) * 1000:7.0f} ms")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
