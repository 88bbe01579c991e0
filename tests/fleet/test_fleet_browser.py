"""The fleet page in Chromium: hosts and sandboxes appear and change live, without reloading."""

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from django.db import connections
from django.utils import timezone

from sandboxes.fleet.heartbeat import HostHeartbeat, QueueMetrics, SandboxStatus
from tests.browser import chromium_page, login
from webapp.fleet.models import SandboxHost
from webapp.fleet.services import host_heartbeat_record, hosts_mark_lost

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def beat(name, sandboxes, *, queue=None, cpu=35.0, starting=0, runtime="runc"):
    return HostHeartbeat(host_name=name, backend="docker", runtime=runtime, slots_total=max(len(sandboxes), 8),
                         slots_used=len(sandboxes), starting=starting, cpu_percent=cpu, memory_percent=40.0, memory_used_mb=4096,
                         sandboxes=tuple(sandboxes), queue=queue or QueueMetrics())


def off_loop(function, **kwargs):
    """Playwright's sync API runs an event loop here, so the ORM must be called from another thread."""
    def call():
        try:
            return function(**kwargs)
        finally:
            connections.close_all()

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(call).result()


def make_lost(name):
    SandboxHost.objects.filter(name=name).update(last_heartbeat_at=timezone.now() - timedelta(seconds=60))
    return hosts_mark_lost(stale_after_s=10)


def test_fleet_page_shows_live_hosts_and_sandboxes(owner, asgi_server):
    base = f"http://{asgi_server}"
    host_heartbeat_record(heartbeat=beat("node-a", [SandboxStatus(f"a-{i}", "idle", "training") for i in range(3)]))
    with chromium_page("test_fleet_page_shows_live_hosts_and_sandboxes") as page:
        login(page, base, "owner", "owner-pass-123")
        page.goto(f"{base}/fleet/")
        assert page.locator("h1").inner_text() == "Fleet"
        card_a = page.locator('.fleet-host[data-host="node-a"]')
        assert card_a.get_attribute("data-sandboxes") == "3"
        page.wait_for_selector('#ws-status[data-status="live"]', timeout=15000)

        # A new host reports 500 sandboxes (some busy, some product) and a queue: it appears live.
        many = [SandboxStatus(f"b-{i:03d}", "busy" if i % 5 == 0 else "idle", "product" if i % 7 == 0 else "training",
                              cpu_percent=100.0 if i % 5 == 0 else 0.0, memory_mb=64.0)
                for i in range(500)]
        off_loop(host_heartbeat_record,
                 heartbeat=beat("node-b", many, queue=QueueMetrics(product_waiting=2, training_waiting=9), cpu=91.0,
                                starting=4, runtime="runsc"))
        card_b = page.locator('.fleet-host[data-host="node-b"]')
        card_b.wait_for(timeout=10000)
        assert card_b.get_attribute("data-sandboxes") == "500"
        assert card_b.get_attribute("data-busy") == "100"
        assert card_b.get_attribute("data-starting") == "4"
        page.wait_for_function("document.getElementById('total-sandboxes').textContent === '503'", timeout=10000)
        assert page.locator("#total-queue").inner_text() == "11"
        assert "500 sandboxes (+4 starting)" in card_b.locator(".meta").inner_text()
        assert card_b.locator(".meta").inner_text().startswith("docker/runsc · ")  # each host's backend and runtime
        assert "queue 11 (2 product)" in card_b.locator(".meta").inner_text()
        assert card_b.locator('.bar[data-metric="cpu"]').get_attribute("class") == "bar hot"
        # The sandbox grid is drawn on a canvas: the first cell (busy) is painted busy-blue.
        pixel = page.evaluate(
            """() => { const c = document.querySelector('.fleet-host[data-host="node-b"] canvas');
                       return Array.from(c.getContext('2d').getImageData(5, 5, 1, 1).data); }""")
        assert pixel[:3] == [0x1F, 0x6F, 0xEB]
        # Coloured by utilisation instead: the busy sandbox at 100% CPU is red-hot.
        page.select_option("#colour-mode", "cpu")
        pixel = page.evaluate(
            """() => { const c = document.querySelector('.fleet-host[data-host="node-b"] canvas');
                       return Array.from(c.getContext('2d').getImageData(5, 5, 1, 1).data); }""")
        assert pixel[:3] == [248, 81, 73]

        # node-a goes silent and is declared lost: its card turns lost and its sandboxes leave the grid.
        assert off_loop(make_lost, name="node-a") == ["node-a"]
        page.wait_for_selector('.fleet-host[data-host="node-a"][data-state="lost"]', timeout=10000)
        assert card_a.get_attribute("data-sandboxes") == "0"
        page.wait_for_function("document.getElementById('total-hosts').textContent === '1'", timeout=10000)
        # The utilisation chart (ECharts) rendered from the heartbeat samples.
        page.wait_for_selector("#fleet-chart canvas", timeout=10000)
