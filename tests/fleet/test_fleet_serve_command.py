"""`manage.py fleet_serve` end to end: a real Ray, a host heartbeating into the database, clean stop."""

import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, _test_database_env


@pytest.mark.django_db(transaction=True)
def test_fleet_serve_runs_a_host_and_stops_it_cleanly():
    from webapp.fleet.models import SandboxHost

    env = _test_database_env() | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "fleet_serve", "--slots", "3", "--heartbeat", "0.5", "--backend", "local"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not SandboxHost.objects.filter(state="alive").exists():
            assert proc.poll() is None, f"fleet_serve exited early: {proc.stdout.read()}"
            assert time.monotonic() < deadline, "no heartbeat from the fleet within 90 s"
            time.sleep(0.2)
        host = SandboxHost.objects.get()
        assert (host.slots_total, host.backend) == (3, "local")
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output
    assert "fleet running" in output and "stopping: 0 sandboxes destroyed" in output
    host.refresh_from_db()
    assert host.state == "stopped"
