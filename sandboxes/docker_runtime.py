"""The Docker backend's OCI runtime: is it registered with the engine, and can it run a sandbox here?

``runc`` is the engine's default. ``runsc`` (gVisor) puts a user-space kernel between the agent's
code and the host's (docs/SECURITY.md); it must be registered in the engine's ``daemon.json``
``runtimes`` with ``--network=none`` among its ``runtimeArgs`` where gVisor cannot network (a nested
engine). A registered runtime is not yet a working one: Debian bookworm's runsc (2022-12) starts
containers but fails ``statx`` calls of the sandbox image's coreutils and dies under the backend's
pids limit (docs/notebook/2026-11-29c-issue-51.md), and the backend's timeout kill (host pids)
does not reach commands inside gVisor (the sentry runs them; the host sees only ``runsc exec``), so
under gVisor a timed-out command is killed from inside the sandbox (``gvisor_kill_command``). A
runtime other than ``runc`` is proven with one real sandbox before the backend accepts it
(``runtime_self_test``).
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from typing import TYPE_CHECKING

from sandboxes.base import BackendUnavailable, SandboxError, SandboxLimits

if TYPE_CHECKING:
    from sandboxes.docker_backend import DockerBackend

SELF_TEST_LIMITS = SandboxLimits(cpu_seconds=20, memory_mb=512, max_processes=64, disk_mb=64,
                                 command_timeout_s=10.0, lifetime_s=120.0)
"""Limits of the self-test sandbox: as tight as the suite's, so a runtime that cannot live inside
them is refused at start rather than at an agent's first command."""
SELF_TEST_COMMAND = "ls -la /workspace >/dev/null && stat -c %s probe.txt && cat probe.txt && echo out > out.txt"
"""What the self-test runs: directory listing and ``statx`` (coreutils), a read and a write of the
bind-mounted workspace."""
PROBE_TEXT = "flowstate runtime probe\n"
LINGER_S = 97
"""Duration of the self-test's command that must be killed at its 1 s timeout (a recognisable argv)."""
COUNT_LINGERING = (
    "python3 -c \"import os\n"
    "def argv(pid):\n"
    "    try:\n"
    "        return open(f'/proc/{pid}/cmdline', 'rb').read()\n"
    "    except OSError:\n"
    "        return b''\n"
    f"print(sum(argv(p) == b'sleep\\0{LINGER_S}\\0' for p in os.listdir('/proc') if p.isdigit()))\""
)
"""Counts the sandbox's processes still running ``sleep LINGER_S`` (python: no coreutils ``statx``)."""
RUNSC_PIDS_OVERHEAD = 128
"""Host tasks a runsc sandbox needs besides those that grow with the guest's processes: its sentry and
gofer threads count against the container's pids cgroup (58 host tasks for an idle sandbox, 71
during one exec). Past the pids limit the sentry cannot start a thread and the whole sandbox dies."""
RUNSC_PIDS_PER_PROCESS = 2
"""Host tasks allowed per guest process on top of ``RUNSC_PIDS_OVERHEAD``: the platform keeps host stub
tasks for the guest's address spaces, so a fork bomb capped at ``max_processes`` (``RLIMIT_NPROC``)
still multiplies host tasks. Measured with ``max_processes=64``: a fork bomb killed the sandbox with
128 host tasks to spare and left it alive, three times in three, with 256."""


EXEC_MARK = "FLOWSTATE_EXEC"
"""Environment variable that tags every process of one command run under gVisor with that command's
token (children inherit it), so the in-sandbox kill finds them."""
_KILL_SCRIPT = """
import os, signal, time
mark = b'%s=%s'
def table():
    rows = {}
    for name in os.listdir('/proc'):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            environ = open('/proc/' + name + '/environ', 'rb').read().split(b'\\0')
            fields = open('/proc/' + name + '/stat', 'rb').read().rsplit(b')', 1)[1].split()
        except OSError:
            continue
        rows[int(name)] = (int(fields[1]), int(fields[4]), mark in environ)
    return rows
def members():
    rows = table()
    found = {pid for pid, (_, _, marked) in rows.items() if marked}
    found |= {pid for pid, (_, session, _) in rows.items() if session in found}
    while True:
        more = {pid for pid, (parent, _, _) in rows.items() if parent in found} - found
        if not more:
            return found
        found |= more
def send(pids, number):
    for pid in pids:
        try:
            os.kill(pid, number)
        except OSError:
            pass
left = -1
for _ in range(20):
    stopped = set()
    for _ in range(200):
        new = members() - stopped
        if not new:
            break
        send(new, signal.SIGSTOP)
        stopped |= new
    send(stopped, signal.SIGKILL)
    time.sleep(0.01)
    left = len(members())
    if not left:
        break
print(left)
"""
"""Kills every process of one command inside a gVisor sandbox: those carrying its ``EXEC_MARK``
token, the members of sessions they lead, and all their descendants. They are stopped first until
no new one appears (a stopped process cannot fork, so a fork bomb cannot outrun the kill), then
killed; repeated until none is left. Run as the agent's uid (no capability is needed to signal
one's own processes); prints how many were still found on the last pass (0: all gone)."""
GVISOR_KILL_TIMEOUT_S = 10.0


def gvisor_kill_command(token: str) -> str:
    """The shell command that kills the processes of the command tagged ``token`` (``_KILL_SCRIPT``)."""
    if not token.isalnum():
        raise ValueError(f"exec token {token!r} is not alphanumeric")
    script = _KILL_SCRIPT % (EXEC_MARK, token)
    return "exec python3 -c '" + script.replace("'", "'\\''") + "'"


def engine_runtimes(client) -> tuple[str, ...]:
    """Names of the OCI runtimes the Docker engine has registered (``docker info``)."""
    return tuple(sorted((client.info().get("Runtimes") or {}).keys()))


def runtime_missing(client, runtime: str) -> str | None:
    """Why ``runtime`` cannot be used on this engine (not registered), else None."""
    registered = engine_runtimes(client)
    if runtime in registered:
        return None
    return (f"the Docker engine has no OCI runtime {runtime!r} (SANDBOX_DOCKER_RUNTIME; registered: "
            f"{', '.join(registered) or 'none'}); register it in /etc/docker/daemon.json \"runtimes\" and "
            "reload dockerd (kill -HUP), see docs/SECURITY.md")


def runtime_is_gvisor(client, runtime: str) -> bool:
    """Whether the engine's ``runtime`` is gVisor: its registered binary is ``runsc`` (a name such as
    ``runsc-ptrace`` is only a label in ``daemon.json``; the binary decides)."""
    entry = (client.info().get("Runtimes") or {}).get(runtime) or {}
    return os.path.basename(str(entry.get("path") or runtime)) == "runsc"


def gvisor_rlimits(limits: SandboxLimits) -> dict[str, int]:
    """Per-process limits (``setrlimit`` names, for Docker ``ulimits``) added under gVisor, where the
    host's cgroups see only the sentry: over the memory cgroup the host kernel kills the sentry (the
    whole sandbox) and past the pids cgroup the sentry cannot start threads and dies. gVisor enforces
    ``RLIMIT_AS`` and ``RLIMIT_NPROC`` itself, per process and per sandbox-kernel uid, so one greedy
    process gets ``MemoryError`` and a fork bomb gets ``EAGAIN`` inside the sandbox, as under runc.
    (Under runc ``RLIMIT_NPROC`` would count the uid's processes on the whole host, so it is not set.)"""
    return {"as": limits.memory_mb * 2**20, "nproc": limits.max_processes}


def runtime_pids_overhead(gvisor: bool, max_processes: int) -> int:
    """Host tasks added to a container's pids limit for the runtime's own threads and stubs."""
    return RUNSC_PIDS_OVERHEAD + RUNSC_PIDS_PER_PROCESS * max_processes if gvisor else 0


def runtime_self_test(backend: DockerBackend) -> None:
    """Start one sandbox container under ``backend.runtime`` and run ``SELF_TEST_COMMAND`` in it.

    Then a command that outlives its timeout must be gone from the sandbox: the backend kills
    timed-out commands by their host pids, which under a runtime that keeps the sandbox's processes
    out of the host's view (gVisor) would only end the ``runsc exec`` process.

    Raises ``BackendUnavailable`` with what failed (the command's output, or the container's death).
    """
    from sandboxes.docker_backend import AGENT_UID

    sandbox_id = "dselftest-" + secrets.token_hex(6)
    workspace = backend.root / "sandboxes" / sandbox_id / "workspace"
    workspace.mkdir(parents=True)
    (workspace / "probe.txt").write_text(PROBE_TEXT)
    for path in (workspace, workspace / "probe.txt"):
        os.chown(path, AGENT_UID, AGENT_UID)
    container = None
    try:
        container = backend._container_start(sandbox_id=sandbox_id, image=backend.image, limits=SELF_TEST_LIMITS,
                                             workspace=workspace, deadline=time.time() + SELF_TEST_LIMITS.lifetime_s)
        try:
            _files_check(backend, container, workspace)
            _timeout_kill_check(backend, container)
        except BackendUnavailable:
            raise
        except SandboxError as exc:
            raise BackendUnavailable(f"OCI runtime {backend.runtime!r} cannot run a sandbox here: {exc}") from None
    except BackendUnavailable:
        raise
    except SandboxError as exc:
        raise BackendUnavailable(f"OCI runtime {backend.runtime!r} cannot start a sandbox here: {exc}") from None
    finally:
        if container is not None:
            backend._container_remove(container)
        shutil.rmtree(workspace.parent, ignore_errors=True)


def _files_check(backend: DockerBackend, container: str, workspace) -> None:
    result = backend._exec(container, SELF_TEST_COMMAND, SELF_TEST_LIMITS.command_timeout_s)
    expected = f"{len(PROBE_TEXT)}\n{PROBE_TEXT}"
    wrote = (workspace / "out.txt").is_file() and (workspace / "out.txt").read_text() == "out\n"
    if result.exit_code != 0 or result.stdout != expected or not wrote:
        output = " ".join((result.stdout + result.stderr).split())[:400]
        raise BackendUnavailable(f"OCI runtime {backend.runtime!r} cannot run a sandbox here: {SELF_TEST_COMMAND!r} "
                                 f"exited {result.exit_code}: {output}")


def _timeout_kill_check(backend: DockerBackend, container: str) -> None:
    timed_out = backend._exec(container, f"sleep {LINGER_S}", 1.0)
    survivors = backend._exec(container, COUNT_LINGERING, SELF_TEST_LIMITS.command_timeout_s)
    if not timed_out.timed_out or survivors.exit_code != 0 or survivors.stdout.strip() != "0":
        raise BackendUnavailable(
            f"OCI runtime {backend.runtime!r}: a timed-out command is not killed in the sandbox (timed_out="
            f"{timed_out.timed_out}, processes left: {(survivors.stdout + survivors.stderr).strip()[:200]!r})"
        )


def main(argv: list[str] | None = None) -> int:
    """``python -m sandboxes.docker_runtime RUNTIME``: run the start-up self-test of one runtime.

    Exit 0 when a sandbox works under it, 1 with the reason otherwise; ``--image-optional`` exits 0
    with a note where the sandbox image is not built yet (scripts/install_runsc.sh runs before it).
    """
    import argparse
    import tempfile
    from pathlib import Path

    from sandboxes.docker_backend import DockerBackend, DockerBackendConfig

    parser = argparse.ArgumentParser(prog="python -m sandboxes.docker_runtime", description=main.__doc__)
    parser.add_argument("runtime")
    parser.add_argument("--image-optional", action="store_true")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="flowstate-runtime-test-")
    os.chmod(root, 0o711)
    try:
        DockerBackend(DockerBackendConfig(root=Path(root), runtime=args.runtime)).close()
    except BackendUnavailable as exc:
        if args.image_optional and "sandbox image" in str(exc) and "missing" in str(exc):
            print(f"{args.runtime}: self-test not run: {exc}")
            return 0
        print(f"{args.runtime}: {exc}")
        return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.runtime}: self-test passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
