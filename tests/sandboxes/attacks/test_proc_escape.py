"""/proc and privilege tricks: no host /proc, no init process access, no mounts or new namespaces."""

from __future__ import annotations

from sandboxes.backend_core import COMMAND_ENV
from tests.sandboxes.conftest import host_is_healthy, under_gvisor


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


def test_mounts_namespaces_and_setuid_do_not_elevate(sandbox, sandbox_backend):
    result = sandbox.exec("mount -t tmpfs none /tmp 2>&1; echo rc=$?; unshare -Ur true 2>&1; echo rc=$?; "
                          "nsenter -t 1 -m true 2>&1; echo rc=$?; id -u")
    codes = [line for line in result.stdout.split() if line.startswith("rc=")]
    if under_gvisor(sandbox_backend):
        # gVisor's own kernel grants user namespaces (the host kernel never sees them); being root in
        # one must still reach nothing outside it: not the read-only image, not the keeper's init
        # (its memory, root, signals), not the sandbox's workspace.
        assert codes[0] != "rc=0" and codes[2] != "rc=0", result.stdout
        inside = sandbox.exec("unshare -Urm sh -c 'touch /usr/bin/pwned; echo rc=$?; head -c 16 /proc/1/mem; echo rc=$?; "
                              "ls /proc/1/root/; echo rc=$?; kill -STOP 1; echo rc=$?; "
                              "mount -t tmpfs none /workspace && touch /workspace/inner; "
                              "tr \"\\0\" \"\\n\" < /proc/1/environ'")
        assert inside.stdout.count("rc=") == 4 and "rc=0" not in inside.stdout, inside
        # Measured: gVisor lets the namespace's root read init's environment (Linux would not); it is
        # the sandbox's own command environment, nothing of the host's.
        names = {line.split("=", 1)[0] for line in inside.stdout.splitlines() if "=" in line and not line.startswith("rc=")}
        assert names <= {*COMMAND_ENV, "HOSTNAME"}, names
        assert sandbox.exec("ls /workspace/inner").exit_code != 0
        assert sandbox.exec("id -u").stdout.strip() != "0"
    else:
        assert codes == ["rc=1", "rc=1", "rc=1"] or all(code != "rc=0" for code in codes), result.stdout
    assert sandbox.exec("touch /usr/bin/pwned 2>&1; echo rc=$?").stdout.strip().endswith("rc=1")
