"""Sandbox and tool latencies per backend: warm claim, cold create, fork, each tool, parallel reads, capacity.

Baselines measured in the same run:
* cold create vs spawning ``unshare --user --map-root-user --mount --pid --net --fork true`` (the bare
  namespace cost, no root filesystem, no overlay, no limits);
* warm claim vs cold create; fork of N (per sandbox) vs a cold create;
* each tool call vs the closest host-side operation (a host file read, a host ``sh -c true``);
* 10 read_file calls in one batch (thread pool) vs the same 10 one after another;
* capacity: how many limited sandboxes run at once (target >= 128), each answering a command.

Run as root:  .venv/bin/python benchmarks/bench_sandbox_tools.py [--quick] [--backends local,docker]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from sandboxes.base import RepoSource, SandboxLimits
from sandboxes.tools import ToolCall, execute_tool_calls

LIMITS = SandboxLimits(cpu_seconds=60, memory_mb=512, max_processes=64, disk_mb=64, command_timeout_s=30,
                       lifetime_s=900)


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def report(name: str, samples: list[float], baseline: list[float] | None = None, baseline_name: str = "") -> None:
    p50, p95 = percentiles(samples)
    line = f"{name:<38} p50 {p50 * 1000:9.2f} ms   p95 {p95 * 1000:9.2f} ms   (n={len(samples)})"
    if baseline:
        line += f"   ratio vs {baseline_name}: {p50 / percentiles(baseline)[0]:.3g}x"
    print(line, flush=True)


def timed(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def make_repo(root: Path, files: int) -> Path:
    repo = root / "repo"
    for index in range(files):
        path = repo / f"pkg{index % 5}" / f"module_{index}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"def function_{index}_{line}(x):\n    return x + {line}\n\n" for line in range(40)))
    return repo


def make_backend(name: str, root: Path, warm: int):
    if name == "local":
        from sandboxes.local_backend import LocalBackend, LocalBackendConfig

        return LocalBackend(LocalBackendConfig(root=root, warm_pool_size=warm))
    from sandboxes.docker_backend import DockerBackend, DockerBackendConfig

    return DockerBackend(DockerBackendConfig(root=root, warm_pool_size=warm))


def bench_lifecycle(name: str, backend, snapshot, reps: int, fork_count: int) -> list[float]:
    bare = [timed(lambda: subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "--pid", "--net", "--fork", "true"], check=True))
        for _ in range(reps)]
    report("bare namespaces (baseline)", bare)
    cold = []
    for _ in range(reps):
        box = None

        def create():
            nonlocal box
            box = backend.sandbox_create(snapshot=snapshot, limits=LIMITS)

        cold.append(timed(create))
        box.destroy()
    report(f"[{name}] cold create", cold, bare, "bare namespaces")
    forks = []
    for _ in range(max(reps // 4, 2)):
        started = time.perf_counter()
        boxes = backend.sandbox_fork(snapshot=snapshot, count=fork_count, limits=LIMITS)
        forks.append((time.perf_counter() - started) / fork_count)
        for box in boxes:
            box.destroy()
    report(f"[{name}] fork of {fork_count}, per sandbox", forks, cold, "cold create")
    return cold


def bench_warm(name: str, warm_backend, snapshot, reps: int, cold: list[float]) -> None:
    claims = []
    if name == "local":
        warm_backend.prewarm(snapshot=snapshot, limits=LIMITS, wait=True)
    else:
        warm_backend.prewarm(snapshot=snapshot, limits=LIMITS)
    for _ in range(reps):
        deadline = time.monotonic() + 60
        while warm_backend.warm_count(snapshot=snapshot, limits=LIMITS) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        box = None

        def claim():
            nonlocal box
            box = warm_backend.sandbox_create(snapshot=snapshot, limits=LIMITS)

        claims.append(timed(claim))
        box.destroy()
    report(f"[{name}] warm claim", claims, cold, "cold create")


def bench_tools(name: str, backend, snapshot, reps: int, repo: Path) -> None:
    box = backend.sandbox_create(snapshot=snapshot, limits=LIMITS)
    try:
        host_file = repo / "pkg0" / "module_0.py"
        host_read = [timed(lambda: host_file.read_bytes()) for _ in range(reps)]
        report("host file read (baseline)", host_read)
        host_sh = [timed(lambda: subprocess.run(["sh", "-c", "true"], check=True)) for _ in range(reps)]
        report("host sh -c true (baseline)", host_sh)
        calls = {
            "read_file": ({"path": "pkg0/module_0.py"}, host_read, "host file read"),
            "list_dir": ({"path": "pkg1"}, host_read, "host file read"),
            "create_file": ({"path": "scratch/new.py", "content": "x = 1\n", "overwrite": True}, host_read,
                            "host file read"),
            "edit_file": (None, host_read, "host file read"),
            "grep": ({"pattern": r"def function_3_\d+", "globs": ["*.py"]}, host_sh, "host sh -c true"),
            "read_lints": ({}, host_sh, "host sh -c true"),
            "run_terminal": ({"command": "true"}, host_sh, "host sh -c true"),
            "todo_write": ({"todos": [{"id": "1", "content": "x", "status": "pending"}]}, host_read,
                           "host file read"),
        }
        box.write_bytes("pkg1/module_1.py", box.read_bytes("pkg1/module_1.py") + b"\nimport os\n")
        for tool, (arguments, baseline, baseline_name) in calls.items():
            samples = []
            for rep in range(reps):
                if tool == "edit_file":
                    old, new = ("return x + 7\n", "return x + 70\n") if rep % 2 == 0 else \
                        ("return x + 70\n", "return x + 7\n")
                    arguments = {"path": "pkg2/module_2.py", "old_str": f"_2_7(x):\n    {old}",
                                 "new_str": f"_2_7(x):\n    {new}"}
                started = time.perf_counter()
                result = execute_tool_calls(sandbox=box, calls=[ToolCall("b", tool, arguments)])[0]
                samples.append(time.perf_counter() - started)
                if not result.ok:
                    raise RuntimeError(f"{tool} failed during the benchmark: {result.output}")
            report(f"[{name}] tool {tool}", samples, baseline, baseline_name)
        batch = [ToolCall(str(i), "read_file", {"path": f"pkg{i % 5}/module_{i}.py"}) for i in range(10)]
        sequential = [timed(lambda: [execute_tool_calls(sandbox=box, calls=[c]) for c in batch]) for _ in range(reps)]
        parallel = [timed(lambda: execute_tool_calls(sandbox=box, calls=batch)) for _ in range(reps)]
        report(f"[{name}] 10 read_file one by one", sequential)
        report(f"[{name}] 10 read_file in one batch", parallel, sequential, "one by one")
        grep_batch = [ToolCall(str(i), "grep", {"pattern": f"function_{i}_1\\b"}) for i in range(10)]
        sequential = [timed(lambda: [execute_tool_calls(sandbox=box, calls=[c]) for c in grep_batch])
                      for _ in range(max(reps // 5, 2))]
        parallel = [timed(lambda: execute_tool_calls(sandbox=box, calls=grep_batch))
                    for _ in range(max(reps // 5, 2))]
        report(f"[{name}] 10 grep one by one", sequential)
        report(f"[{name}] 10 grep in one batch", parallel, sequential, "one by one")
    finally:
        box.destroy()


def bench_capacity(name: str, backend, snapshot, target: int) -> None:
    import psutil

    limits = SandboxLimits(cpu_seconds=10, memory_mb=256, max_processes=32, disk_mb=16, command_timeout_s=30,
                           lifetime_s=900)
    boxes = []
    available_before = psutil.virtual_memory().available
    started = time.perf_counter()
    try:
        for _ in range(target):
            boxes.append(backend.sandbox_create(snapshot=snapshot, limits=limits))
        created_s = time.perf_counter() - started
        answered = sum(box.exec("echo up").stdout == "up\n" for box in boxes)
        used_mb = (available_before - psutil.virtual_memory().available) / 2**20
        print(f"[{name}] capacity: {len(boxes)} limited sandboxes running at once, {answered} answered a command; "
              f"created in {created_s:.1f}s ({created_s / len(boxes) * 1000:.0f} ms each); host memory used "
              f"{used_mb:.0f} MiB ({used_mb / len(boxes):.1f} MiB per sandbox); ratio vs target {target}: "
              f"{answered / target:.2f}x", flush=True)
    finally:
        for box in boxes:
            box.destroy()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    parser.add_argument("--backends", default="local", help="comma-separated: local,docker")
    parser.add_argument("--fork", type=int, default=8, help="sandboxes per fork")
    parser.add_argument("--capacity", type=int, default=128, help="concurrent sandboxes to start (local only)")
    parser.add_argument("--files", type=int, default=50, help="files in the benchmark repository")
    args = parser.parse_args()
    reps = 8 if args.quick else 30
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    for name in args.backends.split(","):
        root = Path(tempfile.mkdtemp(prefix=f"bench-sbx-{name}-", dir="/tmp"))
        root.chmod(0o711)
        repo = make_repo(root, args.files)
        cold_backend = make_backend(name, root / "cold", 0)
        warm_backend = make_backend(name, root / "warm", 4)
        try:
            snapshot = cold_backend.snapshot_create(source=RepoSource(kind="path", location=str(repo)))
            warm_snapshot = warm_backend.snapshot_create(source=RepoSource(kind="path", location=str(repo)))
            cold = bench_lifecycle(name, cold_backend, snapshot, reps, args.fork)
            bench_warm(name, warm_backend, warm_snapshot, reps, cold)
            bench_tools(name, cold_backend, snapshot, reps, repo)
            if name == "local" and args.capacity:
                bench_capacity(name, cold_backend, snapshot, args.capacity)
        finally:
            warm_backend.close()
            cold_backend.close()
            shutil.rmtree(root, ignore_errors=True)
    print(f"load average at end: {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
