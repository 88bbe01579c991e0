"""Per-sandbox CPU and memory by PID namespace, on every backend."""

import time

import pytest

from sandboxes.fleet.usage import SandboxUsageSampler
from tests.sandboxes.conftest import TEST_LIMITS, under_gvisor


def test_busy_sandbox_shows_cpu_and_idle_one_does_not(sandbox_backend, make_snapshot):
    if under_gvisor(sandbox_backend):
        pytest.skip("per-sandbox usage is grouped by PID namespace, and gVisor's runsc-sandbox process (the "
                    "container's host pid) runs in the host's PID namespace (measured: two sandboxes, both "
                    "pid:[same as the host]), so the fleet page shows no per-sandbox CPU/memory under runsc")
    snapshot = make_snapshot({"spin.sh": "while :; do :; done\n"})
    busy = sandbox_backend.sandbox_create(snapshot=snapshot, limits=TEST_LIMITS)
    idle = sandbox_backend.sandbox_create(snapshot=snapshot, limits=TEST_LIMITS)
    try:
        # Background children outlive the command, so the spinner keeps running between samples.
        busy.exec("timeout 20 sh spin.sh > /dev/null 2>&1 &")
        sampler = SandboxUsageSampler()
        pids = {busy.id: busy.holder_pid, idle.id: idle.holder_pid}
        first = sampler.sample(pids)
        assert first[busy.id].cpu_percent == 0.0  # no rate before a second sample
        time.sleep(1.0)
        second = sampler.sample(pids)
        assert second[busy.id].cpu_percent > 10.0
        assert second[idle.id].cpu_percent < 5.0
        assert second[busy.id].memory_mb > 0.0
        busy.exec("pkill -f spin.sh || kill $(pgrep -f spin.sh)")
    finally:
        busy.destroy()
        idle.destroy()
    assert sampler.sample({busy.id: 999_999_999}) == {}
