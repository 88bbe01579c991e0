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


def test_setup_commands_see_no_host_path_and_still_write_the_snapshot(sandbox_backend, tmp_path):
    """Setup commands write into the snapshot tree itself; before issue 42's fix that tree was bound
    in, and its host path showed in mountinfo."""
    from sandboxes.base import RepoSource
    from tests.sandboxes.conftest import TEST_LIMITS

    repo = tmp_path / "setup-repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "old.txt").write_text("old\n")
    (repo / "gone.txt").write_text("x\n")
    probe = ("{ cat /proc/self/mountinfo /proc/1/mountinfo; tr '\\0' '\\n' < /proc/self/environ; "
             "for p in /proc/[0-9]*; do readlink $p/cwd $p/root $p/exe; done; true; } > probe.txt 2>&1")
    snapshot = sandbox_backend.snapshot_create(
        source=RepoSource(kind="path", location=str(repo)),
        setup_commands=(probe, "rm gone.txt && mkdir -p build/out && echo built > build/out/a.txt && "
                               "mv pkg pkg2 && echo new >> pkg2/old.txt"),
    )
    try:
        with sandbox_backend.sandbox_create(snapshot=snapshot, limits=TEST_LIMITS) as box:
            seen = box.read_bytes("probe.txt").decode()
            assert "workspace" in seen  # the probe did read mountinfo
            for host_path in (str(sandbox_backend.root), str(tmp_path)):
                assert host_path not in seen, [line for line in seen.splitlines() if host_path in line]
            listing = box.exec("cat build/out/a.txt pkg2/old.txt; ls").stdout
            assert listing == "built\nold\nnew\nbuild\npkg2\nprobe.txt\n"
    finally:
        sandbox_backend.snapshot_delete(snapshot=snapshot)
