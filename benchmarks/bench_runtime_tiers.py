"""Cost of each Docker isolation tier (OCI runtime) against runc, measured in one run.

For runc and every gVisor runtime registered with the engine that passes the backend's start-up
self-test (``runsc``, ``runsc-systrap``, ``runsc-ptrace``: ``make gvisor``), on the same snapshot of the
demo repository and the same limits:

* cold create (a container started and answering), warm claim (from the backend's warm pool),
  fork of 8 (per sandbox);
* one ``run_terminal`` of ``true`` (the agent's tool path: docker exec, output capture);
* ``python3 -m unittest`` of the demo repository (a test run, many files and syscalls);
* a toy RL rollout end to end: fresh sandbox, the scripted expert's agent loop on the demo task
  (reads, edits, test runs), the repository's tests as the reward, the sandbox destroyed;
* checks of the tools as agents use them: list_dir, read_file of a 4 MiB file, grep, and a command
  killed at its timeout leaves no process behind.

Each figure is a median over rounds that interleave the runtimes; the ratio is runtime / runc.
Run as root, nice'd:
  nice .venv/bin/python benchmarks/bench_runtime_tiers.py [--reps 4] [--runtimes runc,runsc,runsc-ptrace]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from sandboxes.base import BackendUnavailable, RepoSource, SandboxLimits
from sandboxes.tools import ToolCall, execute_tool_calls

LIMITS = SandboxLimits(cpu_seconds=120, memory_mb=512, max_processes=64, disk_mb=64, command_timeout_s=60,
                       lifetime_s=900)
FIGURES = ("cold create", "warm claim", "fork of 8, per sandbox", "run_terminal true", "python -m unittest (demo)",
           "toy RL rollout (scripted expert)")


def tool(box, name: str, arguments: dict):
    return execute_tool_calls(sandbox=box, calls=[ToolCall("c", name, arguments)])[0]


def rollout(backend, snapshot) -> float:
    """Seconds of one rollout: fresh sandbox, the scripted expert's loop, the tests as reward, destroy."""
    from training.agent.config import AgentLimits
    from training.agent.demo_repo import DEMO_PROMPT, TEST_COMMAND, demo_expert_policy
    from training.agent.loop import run_agent

    started = time.perf_counter()
    box = backend.sandbox_create(snapshot=snapshot, limits=LIMITS)
    try:
        outcome = run_agent(sandbox=box, policy=demo_expert_policy(), prompt=DEMO_PROMPT, limits=AgentLimits())
        passed = box.exec(TEST_COMMAND, timeout_s=60).exit_code == 0
        assert outcome.status == "succeeded" and passed, (outcome.status, outcome.reason)
    finally:
        box.destroy()
    return time.perf_counter() - started


def measure_round(backend, warm_backend, snapshot, warm_snapshot, samples: dict[str, list[float]]) -> None:
    """One sample of each figure on one runtime (``warm_backend`` keeps a warm pool, ``backend`` none)."""
    from training.agent.demo_repo import TEST_COMMAND

    started = time.perf_counter()
    box = backend.sandbox_create(snapshot=snapshot, limits=LIMITS)
    samples["cold create"].append(time.perf_counter() - started)
    started = time.perf_counter()
    tool(box, "run_terminal", {"command": "true"})
    samples["run_terminal true"].append(time.perf_counter() - started)
    started = time.perf_counter()
    tests = box.exec(TEST_COMMAND, timeout_s=60)
    samples["python -m unittest (demo)"].append(time.perf_counter() - started)
    assert not tests.timed_out, tests
    box.destroy()
    deadline = time.monotonic() + 120
    while warm_backend.warm_count(snapshot=warm_snapshot, limits=LIMITS) == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    started = time.perf_counter()
    box = warm_backend.sandbox_create(snapshot=warm_snapshot, limits=LIMITS)
    samples["warm claim"].append(time.perf_counter() - started)
    box.destroy()
    started = time.perf_counter()
    boxes = backend.sandbox_fork(snapshot=snapshot, count=8, limits=LIMITS)
    samples["fork of 8, per sandbox"].append((time.perf_counter() - started) / 8)
    for box in boxes:
        box.destroy()
    samples["toy RL rollout (scripted expert)"].append(rollout(backend, snapshot))


def tool_checks(backend, snapshot) -> list[str]:
    """The tools as agents use them, under this runtime; returns the failures (none: all held)."""
    failures = []
    box = backend.sandbox_create(snapshot=snapshot, limits=LIMITS)
    try:
        box.exec("python3 -c \"open('big.txt', 'w').write(('x' * 1023 + chr(10)) * 4096)\"")
        listing = tool(box, "list_dir", {"path": "."})
        if not listing.ok or "big.txt" not in listing.output:
            failures.append(f"list_dir: {listing.output[:200]}")
        read = tool(box, "read_file", {"path": "big.txt"})
        if not read.ok or "xxxx" not in read.output:
            failures.append(f"read_file of 4 MiB: {read.output[:200]}")
        grep = tool(box, "grep", {"pattern": "def median"})
        if not grep.ok or "median" not in grep.output:
            failures.append(f"grep: {grep.output[:200]}")
        killed = tool(box, "run_terminal", {"command": "sleep 311 & sleep 312", "timeout_s": 2})
        left = box.exec("ps -eo args --no-headers").stdout
        if not killed.meta.get("timed_out") or "sleep 31" in left:
            failures.append(f"timeout kill: timed_out={killed.meta.get('timed_out')} left={left!r}")
    finally:
        box.destroy()
    return failures


def main() -> int:
    from sandboxes.docker_backend import DockerBackend, DockerBackendConfig
    from training.agent.demo_repo import write_demo_repository

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--runtimes", default="runc,runsc,runsc-ptrace",
                        help="runsc runs on systrap, gVisor's default platform")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-tiers-", dir="/tmp"))
    work.chmod(0o711)
    repo = write_demo_repository(work / "demo")
    backends: dict[str, tuple] = {}
    try:
        for runtime in args.runtimes.split(","):
            try:
                backend = DockerBackend(DockerBackendConfig(root=work / runtime, runtime=runtime))
                warm_backend = DockerBackend(DockerBackendConfig(root=work / f"{runtime}-warm", runtime=runtime,
                                                                 warm_pool_size=1))
            except BackendUnavailable as exc:
                print(f"[{runtime}] not measured: {exc}", flush=True)
                continue
            snapshot = backend.snapshot_create(source=RepoSource(kind="path", location=str(repo)))
            warm_snapshot = warm_backend.snapshot_create(source=RepoSource(kind="path", location=str(repo)))
            backends[runtime] = (backend, warm_backend, snapshot, warm_snapshot)
            print(f"[{runtime}] tool checks: {tool_checks(backend, snapshot) or 'all held'}", flush=True)
            warm_backend.prewarm(snapshot=warm_snapshot, limits=LIMITS)
            rollout(backend, snapshot)  # warm-up: the semantic_search encoder loads on first use
        # Rounds interleave the runtimes (in a rotating order), so a change of the machine's load
        # weighs on every runtime alike.
        samples = {runtime: {name: [] for name in FIGURES} for runtime in backends}
        order = list(backends)
        for round_index in range(args.reps):
            for runtime in order[round_index % len(order):] + order[:round_index % len(order)]:
                measure_round(*backends[runtime], samples[runtime])
        results = {runtime: {name: statistics.median(values) for name, values in figures.items()}
                   for runtime, figures in samples.items()}
        for runtime, figures in results.items():
            for name, value in figures.items():
                print(f"[{runtime}] {name:<34} {value * 1000:9.1f} ms", flush=True)
    finally:
        for backend, warm_backend, _, _ in backends.values():
            for each in (backend, warm_backend):
                each.close()
                each.reap_orphans()
        shutil.rmtree(work, ignore_errors=True)
    if "runc" in results:
        print("\nratios runtime/runc (medians)")
        for runtime, figures in results.items():
            if runtime != "runc":
                cells = ", ".join(f"{name}: {figures[name] / results['runc'][name]:.2f}x" for name in FIGURES)
                print(f"  {runtime}: {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
