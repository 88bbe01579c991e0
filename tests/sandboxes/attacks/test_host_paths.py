"""The sandbox cannot learn where the host keeps its state: mountinfo, environment, cwd links."""

from __future__ import annotations


def test_no_host_state_path_visible_inside(sandbox_backend, sandbox):
    root = str(sandbox_backend.root)
    snapshot_dir = str(sandbox.snapshot.location)
    probe = sandbox.exec(
        "cat /proc/self/mountinfo /proc/1/mountinfo 2>/dev/null; tr '\\0' '\\n' < /proc/self/environ; "
        "for p in /proc/[0-9]*; do readlink $p/cwd $p/root $p/exe 2>/dev/null; done"
    )
    seen = probe.stdout + probe.stderr
    assert "workspace" in seen  # the probe did read mountinfo
    assert root not in seen, [line for line in seen.splitlines() if root in line]
    assert snapshot_dir not in seen
