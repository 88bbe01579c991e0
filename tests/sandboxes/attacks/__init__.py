"""Attack suite: one module per sandbox guarantee, run against every available backend.

Threat model (also in docs/SECURITY.md)
---------------------------------------
The adversary is the agent: arbitrary shell commands through ``run_terminal`` and arbitrary
arguments to every file tool, possibly racing its own background processes against the tools.

Defended, and tested here:

* file tools stay inside the workspace: ``..``, absolute paths, symlinks and hard links leading out
  fail with a clear error, also while a background process swaps symlinks (test_path_traversal);
* host secrets stay hidden: ``/etc/shadow``, home directories, ``/root``, the host's environment
  variables, the host's processes and the platform's own files (test_host_secrets);
* no network: host services on loopback (PostgreSQL, Redis, any port) and outside addresses are
  unreachable unless ``SandboxLimits.network`` is set (test_network);
* with ``SandboxLimits.network`` (a repository's setup phase), public addresses only: the host's own
  addresses (loopback or not), private, link-local, metadata and every other refused range of
  ``sandboxes.netguard`` are rejected inside the sandbox's namespace, DNS goes to its forwarder only,
  and the sandbox cannot lift the firewall (test_network_egress, test_netguard_table);
* resource bombs are contained: fork bombs, memory bombs, disk fills and runaway CPU hit the
  sandbox's limits and the host keeps its headroom (test_resource_bombs);
* sandboxes are isolated from each other: no seeing, signalling or reading another sandbox's
  processes or files (test_cross_sandbox);
* ``/proc`` and privilege tricks fail: no capabilities, ``no_new_privs``, no mounts, no nested user
  namespaces, no host ``/proc`` (test_proc_escape).

Not defended: kernel vulnerabilities reachable through allowed system calls (there is no seccomp
filter in the local backend), side channels (CPU caches, timing), and the memory a sandbox's
tmpfs quota occupies counting against host RAM. ``network=True`` allows egress to public addresses,
so a public address that the host's network maps to an internal service (a NAT rule, another machine
of the deployment with a public address) is not told apart, and DNS queries reach the host's resolver.
"""
