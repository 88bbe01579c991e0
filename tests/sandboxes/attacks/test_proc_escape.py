"""/proc and privilege tricks: no host /proc, no init process access, no mounts or new namespaces."""

from __future__ import annotations

from tests.sandboxes.conftest import host_is_healthy


def test_proc_shows_only_the_sandbox(sandbox):
    pids = [p for p in sandbox.exec("ls /proc").stdout.split() if p.isdigit()]
    assert len(pids) < 10, pids


def test_init_process_gives_no_way_back_to_the_host(sandbox):
    """Through pid 1 a sandbox sees at most its own root; never the host's filesystem or memory."""
    result = sandbox.exec("ls /proc/1/root/ 2>&1; echo ---; ls /proc/1/cwd/ 2>&1; echo ---; "
                          "head -c 16 /proc/1/mem >/dev/null 2>&1; echo rc=$?")
    root_listing, cwd_listing, mem = result.stdout.split("---")
    for listing in (root_listing, cwd_listing):
        names = listing.split()
        assert "Permission denied" in listing or "workspace" in names or "README.md" in names, listing
        assert "work" not in names and ".pyenv" not in names
    assert "rc=0" not in mem


def test_kernel_knobs_are_read_only(sandbox):
    result = sandbox.exec("echo 1 > /proc/sys/kernel/sysrq; echo $?; echo b > /proc/sysrq-trigger; echo $?; "
                          "echo 0 > /proc/sys/vm/overcommit_memory; echo $?")
    codes = [line for line in result.stdout.split() if line.isdigit()]
    assert codes and all(code != "0" for code in codes), result.stdout + result.stderr
    host_is_healthy()


def test_mounts_namespaces_and_setuid_do_not_elevate(sandbox):
    result = sandbox.exec("mount -t tmpfs none /tmp 2>&1; echo rc=$?; unshare -Ur true 2>&1; echo rc=$?; "
                          "nsenter -t 1 -m true 2>&1; echo rc=$?; id -u")
    codes = [line for line in result.stdout.split() if line.startswith("rc=")]
    assert codes == ["rc=1", "rc=1", "rc=1"] or all(code != "rc=0" for code in codes), result.stdout
    assert sandbox.exec("touch /usr/bin/pwned 2>&1; echo rc=$?").stdout.strip().endswith("rc=1")
